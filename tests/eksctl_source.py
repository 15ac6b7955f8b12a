"""eksctl's command line as its own Go source defines it, read from the files vendored in fixtures/eksctl/.

For ``eksctl VERB RESOURCE`` this finds the verb's list of resource commands (``pkg/ctl/VERB/VERB.go``), the one whose
``cmd.SetDescription("RESOURCE", ...)`` names it, and every flag its functions define: the pflag calls
(``fs.StringVarP(&x, "name", "n", default, usage)``, ``fs.Bool("approve", ...)``, ...) in its body, in the same
package's functions it calls and in the ``cmdutils.Add...`` helpers (``AddRegionFlag``, ``AddTimeoutFlag``, ...),
followed with their arguments bound, so a helper's ``if addCfnOptions {`` block counts only when the caller passes
``true``. The flags refused with and without ``--config-file`` come from the ``cmdutils.New...Loader`` the command
calls (``pkg/ctl/cmdutils/configfile.go``). Anything the reader cannot resolve (a helper or loader that is not
vendored, a flag name that is not a string, a pflag call on another receiver) raises :class:`SourceError`: it never
passes by finding nothing. Example::

    create = command("create", "cluster")
    create.flags["timeout"].default        # 'api.DefaultWaitTimeout'
    create.parse(["-f", "c.yaml", "--timeout", "40m"])  # {'config-file': 'c.yaml', 'timeout': '40m'}
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).parent / "fixtures" / "eksctl"
CTL = ROOT / "pkg" / "ctl"
CMDUTILS = CTL / "cmdutils"

# pflag's FlagSet methods that define a flag: the value type, then Var (a pointer first) and/or P (a shorthand).
_TYPES = (
    "BoolSlice|Bool|StringToString|StringSlice|StringArray|String|IntSlice|Int64|Int32|Int|"
    "Uint|Float64|Float32|Duration|IPNet|IP"
)
_DEFINE = re.compile(rf"\bfs\.({_TYPES})(Var)?(P)?\(")
# A flag defined on any other flag set (a command's Flags() or PersistentFlags()) would escape the reader.
_OTHER_SET = re.compile(rf"\.(?:Persistent)?Flags\(\)\.(?:{_TYPES})(?:Var)?P?\(")
_BODY = re.compile(r"\{[ \t]*(?://[^\n]*)?\n")
_GO_FUNC = re.compile(r"^func\s+(\w+)\s*\(", re.MULTILINE)
_STRING = re.compile(r'^"((?:[^"\\]|\\.)*)"$')
_DURATION = re.compile(r"^(\d+(\.\d*)?(ns|us|µs|ms|s|m|h))+$|^0$")


class SourceError(AssertionError):
    """The vendored source does not say what was asked (a command, a helper, a flag name): fail, never guess."""


class ArgvError(ValueError):
    """What eksctl (cobra and pflag, or eksctl's config loader) answers for a bad command line; ``str()`` is the
    message eksctl prints after ``Error: ``."""


@dataclass(frozen=True)
class Flag:
    """One flag: ``kind`` is pflag's value type (``Bool``, ``String``, ``Duration``, ...), ``default`` the Go
    expression of its default, ``origin`` the vendored file that defines it."""

    name: str
    shorthand: str | None
    kind: str
    default: str
    origin: str
    deprecated: bool = False

    @property
    def is_bool(self) -> bool:
        return self.kind == "Bool"


@dataclass(frozen=True)
class Command:
    verb: str
    resource: str
    aliases: tuple[str, ...]
    flags: dict[str, Flag]
    loaders: tuple[str, ...]
    refused_with_config_file: frozenset[str] = field(default_factory=frozenset)
    refused_without_config_file: frozenset[str] = field(default_factory=frozenset)

    def parse(self, args: list[str]) -> dict[str, str | bool]:
        """The flags given in ``args`` (after ``eksctl VERB RESOURCE``), as pflag reads them: ``--name value``,
        ``--name=value``, ``-n value``, a bare bool flag or ``--flag=false``. Raises :class:`ArgvError` with
        eksctl's words for an unknown flag, a missing value, a bad bool, int or duration, and a flag the config
        loader refuses with (or without) ``--config-file``."""
        by_short = {f.shorthand: f for f in self.flags.values() if f.shorthand}
        given: dict[str, str | bool] = {}
        positional: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg.startswith("--") and len(arg) > 2:
                name, eq, value = arg[2:].partition("=")
                flag = self.flags.get(name)
                if flag is None:
                    raise ArgvError(f"unknown flag: --{name}")  # pflag's error (flag.go, failf)
            elif arg.startswith("-") and len(arg) > 1:
                short, rest = arg[1], arg[2:]
                flag = by_short.get(short)
                if flag is None:
                    raise ArgvError(f"unknown shorthand flag: {short!r} in {arg}")
                eq, value = ("=", rest[1:]) if rest.startswith("=") else (("=", rest) if rest else ("", ""))
            else:
                positional.append(arg)
                continue
            if flag.is_bool:
                if not eq:
                    given[flag.name] = True
                    continue
                if value not in ("true", "false", "1", "0", "t", "f", "TRUE", "FALSE", "True", "False"):
                    raise ArgvError(f'invalid argument "{value}" for "--{flag.name}" flag: invalid syntax')
                given[flag.name] = value in ("true", "1", "t", "TRUE", "True")
                continue
            if not eq:
                if i >= len(args):
                    raise ArgvError(f"flag needs an argument: --{flag.name}")
                value = args[i]
                i += 1
            _check_value(flag, value)
            given[flag.name] = value
        if len(positional) > 1:
            raise ArgvError("only one argument is allowed to be used as a name")  # cmdutils.GetNameArg
        refused = self.refused_with_config_file if "config-file" in given else self.refused_without_config_file
        for name in sorted(refused):  # the loader's findChangedFlag walks its list in sorted order
            if name in given:
                if "config-file" in given:
                    raise ArgvError(f"cannot use --{name} when --config-file/-f is set")  # ErrCannotUseWithConfigFile
                raise ArgvError(f"cannot use --{name} unless a config file is specified via --config-file/-f")
        return given

    def value(self, given: dict[str, str | bool], name: str) -> str | bool:
        """What eksctl works with for ``name``: the given value, else the flag's default as a Go expression."""
        if name not in self.flags:
            raise SourceError(f"eksctl {self.verb} {self.resource} defines no flag --{name}")
        if name in given:
            return given[name]
        default = self.flags[name].default
        return {"true": True, "false": False}.get(default, default)


def _check_value(flag: Flag, value: str) -> None:
    bad = ArgvError(f'invalid argument "{value}" for "--{flag.name}" flag')
    if flag.kind == "Duration" and not _DURATION.match(value):
        raise ArgvError(f'{bad}: time: invalid duration "{value}"')
    if flag.kind in ("Int", "Int32", "Int64", "Uint") and not re.fullmatch(r"-?\d+", value):
        raise ArgvError(f"{bad}: strconv.ParseInt: parsing {value!r}: invalid syntax")


def go_duration_seconds(value: str) -> float:
    """Seconds of a Go duration (``40m``, ``1h30m``, ``90s``), as ``time.ParseDuration`` reads it."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    if not _DURATION.match(value):
        raise ValueError(f"not a Go duration: {value!r}")
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", value))


# ----------------------------------------------------------------------------------------------------------------
# Reading Go, just enough: top-level functions, balanced brackets, call arguments, string literals
# ----------------------------------------------------------------------------------------------------------------


def _skip_literal(text: str, i: int) -> int:
    """Past the string, rune or comment starting at ``i`` (or ``i`` itself when none starts there)."""
    ch = text[i]
    if ch in "\"'":
        j = i + 1
        while text[j] != ch:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    if ch == "`":
        return text.index("`", i + 1) + 1
    if text.startswith("//", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        return text.index("*/", i + 2) + 2
    return i


def _close(text: str, i: int) -> int:
    """The index just past the bracket that closes the one at ``i``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[text[i]]]
    j = i + 1
    while stack:
        k = _skip_literal(text, j)
        if k != j:
            j = k
            continue
        ch = text[j]
        if ch in pairs:
            stack.append(pairs[ch])
        elif ch in ")}]" and ch != stack.pop():
            raise SourceError(f"unbalanced {ch!r} at {j}")
        j += 1
    return j


def _split_args(inner: str) -> list[str]:
    """The top-level comma-separated parts of a call's argument list."""
    parts, depth, start, j = [], 0, 0, 0
    while j < len(inner):
        k = _skip_literal(inner, j)
        if k != j:
            j = k
            continue
        ch = inner[j]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:j].strip())
            start = j + 1
        j += 1
    last = inner[start:].strip()
    if last:
        parts.append(last)
    return parts


@dataclass(frozen=True)
class _Func:
    name: str
    params: tuple[str, ...]
    body: str
    origin: str


def _functions(path: Path) -> dict[str, _Func]:
    """The top-level functions (not methods) of one Go file."""
    text = path.read_text()
    out = {}
    for match in _GO_FUNC.finditer(text):
        open_paren = match.end() - 1
        after_params = _close(text, open_paren)
        params = []
        for part in _split_args(text[open_paren + 1 : after_params - 1]):
            params.append(part.split()[0])
        # The body's brace ends its line; a result type (`error`, `(x, error)`, `interface{}`) may come before it.
        body = _BODY.search(text, after_params)
        if body is None:
            raise SourceError(f"{path.relative_to(ROOT)}: no body for func {match.group(1)}")
        brace = body.start()
        out[match.group(1)] = _Func(
            match.group(1), tuple(params), text[brace : _close(text, brace)], str(path.relative_to(ROOT))
        )
    return out


@functools.cache
def _package(folder: Path) -> dict[str, _Func]:
    if not folder.is_dir():
        raise SourceError(f"{folder.relative_to(ROOT)} is not vendored")
    funcs: dict[str, _Func] = {}
    for path in sorted(folder.glob("*.go")):
        funcs.update(_functions(path))
    return funcs


def _literal(expr: str, bound: dict[str, str]) -> str | None:
    """The value of a Go string literal, or of a parameter bound to one; None otherwise."""
    expr = bound.get(expr.strip(), expr.strip())
    match = _STRING.match(expr)
    return match.group(1) if match else None


def _calls(body: str, prefix: str) -> list[tuple[str, list[str], int]]:
    """``(name, args, position)`` of each call ``prefix + name(...)`` in ``body``."""
    found = []
    for match in re.finditer(rf"{prefix}(\w+)\(", body):
        start = match.end() - 1
        if _skip_literal(body, match.start()) != match.start():
            continue
        found.append((match.group(1), _split_args(body[start + 1 : _close(body, start) - 1]), match.start()))
    return found


def _skipped_spans(body: str, bound: dict[str, str]) -> list[tuple[int, int]]:
    """The ``if NAME {`` / ``if !NAME {`` blocks that cannot run with the arguments bound (NAME a bool parameter)."""
    spans = []
    for match in re.finditer(r"\bif\s+(!?)(\w+)\s*\{", body):
        value = bound.get(match.group(2))
        if value not in ("true", "false"):
            continue
        runs = (value == "true") != bool(match.group(1))
        if not runs:
            brace = match.end() - 1
            spans.append((brace, _close(body, brace)))
    return spans


@dataclass
class _Walk:
    flags: dict[str, Flag] = field(default_factory=dict)
    descriptions: list[list[str]] = field(default_factory=list)
    loaders: list[str] = field(default_factory=list)
    deprecated: set[str] = field(default_factory=set)
    seen: set[tuple[str, str]] = field(default_factory=set)


def _walk(folder: Path, name: str, args: list[str], walk: _Walk) -> None:
    funcs = _package(folder)
    fn = funcs[name]
    key = (str(folder), name, tuple(args))
    if key in walk.seen:
        return
    walk.seen.add(key)
    bound = {p: a for p, a in zip(fn.params, args, strict=False)}
    if _OTHER_SET.search(fn.body):
        raise SourceError(f"{fn.origin}: {name} defines a flag outside the flag set fs")
    skipped = _skipped_spans(fn.body, bound)

    def live(pos: int) -> bool:
        return not any(a <= pos < b for a, b in skipped)

    for match in _DEFINE.finditer(fn.body):
        if not live(match.start()) or _skip_literal(fn.body, match.start()) != match.start():
            continue
        kind, var, short = match.groups()
        start = match.end() - 1
        call = _split_args(fn.body[start + 1 : _close(fn.body, start) - 1])
        rest = call[1:] if var else call
        flag_name = _literal(rest[0], bound)
        if flag_name is None:
            raise SourceError(f"{fn.origin}: {name}: a flag named by {rest[0]!r}, not a string")
        shorthand = _literal(rest[1], bound) if short else None
        default = bound.get(rest[2 if short else 1], rest[2 if short else 1])
        if flag_name in walk.flags:
            raise SourceError(f"{fn.origin}: --{flag_name} is defined twice for one command")
        walk.flags[flag_name] = Flag(flag_name, shorthand or None, kind, default, fn.origin)
    for call_name, call_args, pos in _calls(fn.body, r"\bfs\."):
        if call_name == "MarkDeprecated" and live(pos):
            deprecated = _literal(call_args[0], bound)
            if deprecated is None:
                raise SourceError(f"{fn.origin}: {name}: MarkDeprecated of {call_args[0]!r}")
            walk.deprecated.add(deprecated)
    for call_name, call_args, pos in _calls(fn.body, r"\bcmd\."):
        if call_name == "SetDescription" and live(pos):
            walk.descriptions.append([_literal(a, bound) or a for a in call_args])
    for call_name, call_args, pos in _calls(fn.body, r"\bcmdutils\."):
        if not live(pos):
            continue
        if call_name.endswith("Loader"):
            walk.loaders.append(call_name)
        elif call_name.lower().startswith("add") and call_name not in ("AddPreRun", "AddResourceCmd"):
            if call_name not in _package(CMDUTILS):
                raise SourceError(f"{fn.origin}: cmdutils.{call_name} is not in the vendored pkg/ctl/cmdutils")
            _walk(CMDUTILS, call_name, [bound.get(a, a) for a in call_args], walk)
    for call_name, call_args, pos in _calls(fn.body, r"(?<![\w.])"):
        if call_name in funcs and call_name != name and live(pos):
            _walk(folder, call_name, [bound.get(a, a) for a in call_args], walk)


# ----------------------------------------------------------------------------------------------------------------
# The config loaders: the flags refused with or without --config-file
# ----------------------------------------------------------------------------------------------------------------


def _string_lists(text: str) -> dict[str, list[str]]:
    """``name = []string{...}`` and ``name := []string{...}`` in ``text``: name -> its string literals."""
    out = {}
    for match in re.finditer(r"\b(\w+)\s*:?=\s*\[\]string\{", text):
        brace = match.end() - 1
        inner = text[brace + 1 : _close(text, brace) - 1]
        out[match.group(1)] = [s for s in re.findall(r'"((?:[^"\\]|\\.)*)"', inner)]
    return out


def _names_in(args: list[str], lists: dict[str, list[str]], where: str) -> list[str]:
    names = []
    for arg in args:
        for token in re.findall(r'"(?:[^"\\]|\\.)*"|\b[A-Za-z_]\w*\b', arg):
            if token.startswith('"'):
                names.append(token[1:-1])
            elif token != "append":
                if token not in lists:
                    raise SourceError(f"{where}: the list {token!r} is not a []string literal of the vendored source")
                names += lists[token]
    return names


@functools.cache
def _loader(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """(refused with --config-file, refused without it) for ``cmdutils.NAME(...)``."""
    funcs = _package(CMDUTILS)
    if name not in funcs:
        raise SourceError(f"cmdutils.{name} is not in the vendored pkg/ctl/cmdutils")
    fn = funcs[name]
    if "newCommonClusterConfigLoader(" not in fn.body:
        raise SourceError(f"{fn.origin}: {name} does not start from newCommonClusterConfigLoader")
    package_text = "\n".join(p.read_text() for p in sorted(CMDUTILS.glob("*.go")))
    lists = {**_string_lists(package_text), **_string_lists(fn.body)}
    common = funcs["newCommonClusterConfigLoader"].body
    sets = {}
    for which in ("flagsIncompatibleWithConfigFile", "flagsIncompatibleWithoutConfigFile"):
        start = re.search(rf"{which}:\s*sets\.New\[string\]\((\w+)\.\.\.\)", common)
        if start is None:
            raise SourceError(f"newCommonClusterConfigLoader: no starting set for {which}")
        names = set(lists[start.group(1)])
        for op, args, _pos in _calls(fn.body, rf"\bl\.{which}\."):
            if op == "Insert":
                names |= set(_names_in(args, lists, fn.origin))
            elif op == "Delete":
                names -= set(_names_in(args, lists, fn.origin))
            else:
                raise SourceError(f"{fn.origin}: {name}: {which}.{op} is not understood")
        sets[which] = frozenset(names)
    return sets["flagsIncompatibleWithConfigFile"], sets["flagsIncompatibleWithoutConfigFile"]


# ----------------------------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------------------------


def resource_functions(verb: str) -> list[str]:
    """The functions that make ``eksctl VERB``'s resource commands, as its ``Command`` lists them."""
    path = CTL / verb / f"{verb}.go"
    if not path.is_file():
        raise SourceError(f"pkg/ctl/{verb}/{verb}.go is not vendored: eksctl {verb} cannot be checked")
    text = path.read_text()
    if f'NewVerbCmd("{verb}"' not in text:
        raise SourceError(f"pkg/ctl/{verb}/{verb}.go does not make the verb {verb!r}")
    names = [m.group(1) for m in re.finditer(r"AddResourceCmd\(\s*\w+\s*,\s*\w+\s*,\s*(\w+)\s*\)", text)]
    for match in re.finditer(r"\[\]func\(\*cmdutils\.Cmd\)\{", text):
        brace = match.end() - 1
        names += re.findall(r"\b(\w+)\s*,", text[brace + 1 : _close(text, brace) - 1] + ",")
    if not names:
        raise SourceError(f"pkg/ctl/{verb}/{verb}.go lists no resource commands")
    return names


@functools.cache
def command(verb: str, resource: str) -> Command:
    """``eksctl VERB RESOURCE`` as the vendored source defines it; :class:`SourceError` when it does not."""
    folder = CTL / verb
    funcs = _package(folder)
    vendored = [n for n in resource_functions(verb) if n in funcs]
    for name in vendored:
        walk = _Walk()
        _walk(folder, name, ["cmd"], walk)
        if len(walk.descriptions) != 1:
            raise SourceError(f"pkg/ctl/{verb}: {name} sets {len(walk.descriptions)} descriptions, not one")
        use = walk.descriptions[0][0]
        aliases = tuple(walk.descriptions[0][3:])
        if resource != use and resource not in aliases:
            continue
        if not walk.flags:
            raise SourceError(f"eksctl {verb} {use}: no flag definitions found in {name}")
        if not walk.loaders:
            raise SourceError(f"eksctl {verb} {use}: no config loader (cmdutils.New...Loader) found in {name}")
        flags = {n: Flag(**{**f.__dict__, "deprecated": n in walk.deprecated}) for n, f in walk.flags.items()}
        unknown = walk.deprecated - set(flags)
        if unknown:
            raise SourceError(f"eksctl {verb} {use}: deprecates flags it does not define: {sorted(unknown)}")
        with_file: frozenset[str] = frozenset()
        without_file: frozenset[str] = frozenset()
        for loader in walk.loaders:  # several (scale: one nodegroup or all): the union, the stricter reading
            refused_with, refused_without = _loader(loader)
            with_file |= refused_with
            without_file |= refused_without
        return Command(verb, use, aliases, flags, tuple(walk.loaders), with_file, without_file)
    raise SourceError(
        f"eksctl {verb} {resource}: no such command in the vendored source (pkg/ctl/{verb}/ vendors the commands "
        f"made by {', '.join(vendored) or 'none'})"
    )


def parse_argv(argv: list[str]) -> tuple[Command, dict[str, str | bool]]:
    """``["eksctl", VERB, RESOURCE, *flags]`` -> the command and its flags (see :meth:`Command.parse`)."""
    if len(argv) < 3 or argv[0] != "eksctl":
        raise SourceError(f"not an eksctl command: {argv}")
    cmd = command(argv[1], argv[2])
    return cmd, cmd.parse(list(argv[3:]))


def wait_seconds(cmd: Command, given: dict[str, str | bool]) -> float:
    """How long eksctl waits for its stacks: ``--timeout`` as given, else its default, ``api.DefaultWaitTimeout``
    read from the vendored pkg/apis/eksctl.io/v1alpha5/types.go."""
    value = str(cmd.value(given, "timeout"))
    if value == "api.DefaultWaitTimeout":
        value = go_constant("pkg/apis/eksctl.io/v1alpha5/types.go", "DefaultWaitTimeout")
        match = re.fullmatch(r"(\d+) \* time\.(Hour|Minute|Second)", value)
        if match is None:
            raise SourceError(f"DefaultWaitTimeout = {value!r} is not N * time.Unit")
        return int(match.group(1)) * {"Hour": 3600, "Minute": 60, "Second": 1}[match.group(2)]
    return go_duration_seconds(value)


def go_constant(relpath: str, name: str) -> str:
    """The Go expression a constant or variable ``name`` is set to in a vendored file (``name = expr``)."""
    text = (ROOT / relpath).read_text()
    match = re.search(rf"^\s*{re.escape(name)}\s*=\s*(.+?)\s*$", text, re.MULTILINE)
    if match is None:
        raise SourceError(f"{relpath} does not set {name}")
    return match.group(1)
