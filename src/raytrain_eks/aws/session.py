"""boto3 sessions and clients for raytrain-eks, and AWS errors turned into one clear message.

boto3 is imported only when a command talks to AWS, so ``plan`` and training never load it. Clients are made once
per (service, region) and shared; boto3 clients are thread-safe once made, their making is not, hence the lock.
``AWS_ENDPOINT_URL`` (botocore's own setting) points every client elsewhere, e.g. at moto's server in tests.
Example::

    aws = connect("us-east-1")              # UserError naming the variables when no credentials are found
    ec2 = aws.client("ec2", "us-west-2")
    with aws_errors("reading the regions"):
        ec2.describe_regions()
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING

from raytrain_eks.errors import UserError

if TYPE_CHECKING:
    from boto3 import Session
    from botocore.client import BaseClient
    from botocore.loaders import Loader

CREDENTIALS_HINT = (
    "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials), or "
    "AWS_PROFILE for a named profile, or run `aws configure` (or `aws sso login --profile NAME`) first."
)

# Error codes meaning "these credentials are not valid", as opposed to "valid but not allowed".
_BAD_CREDENTIAL_CODES = frozenset(
    {
        "AuthFailure",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
    }
)
_DENIED_CODES = frozenset({"UnauthorizedOperation", "AccessDenied", "AccessDeniedException"})


class AwsCredentialsError(UserError):
    """No usable AWS credentials: the message says which ways of giving them exist."""

    exit_code = 2


class AwsError(UserError):
    """An AWS call failed for a reason the user must fix (permissions, network); names the call and the code."""


def import_boto3() -> ModuleType:
    """The ``boto3`` module, or a :class:`UserError` with the install command when it is missing."""
    try:
        import boto3
    except ImportError:
        raise UserError(
            "boto3 is not installed, and this command talks to AWS",
            hint="Install it with `pip install boto3` (it is a dependency of raytrain-eks; reinstall the package).",
        ) from None
    module: ModuleType = boto3
    return module


class Aws:
    """One boto3 session and its clients, made on first use per (service, region).

    ``region``: the default region (the configuration's). ``endpoint_url``: one endpoint for every service, for
    tests; normally None (AWS, or whatever ``AWS_ENDPOINT_URL`` says).
    """

    def __init__(self, session: Session, region: str, *, endpoint_url: str | None = None) -> None:
        self.session = session
        self.region = region
        self.endpoint_url = endpoint_url
        self._clients: dict[tuple[str, str], BaseClient] = {}
        self._lock = threading.Lock()

    def client(self, service: str, region: str | None = None) -> BaseClient:
        """The boto3 client of ``service`` in ``region`` (default: :attr:`region`)."""
        key = (service, region or self.region)
        with self._lock:
            if key not in self._clients:
                from botocore.config import Config as BotoConfig

                # A few retries with back-off for throttling; timeouts so a dead network fails instead of hanging.
                config = BotoConfig(connect_timeout=10, read_timeout=60, retries={"mode": "standard"})
                self._clients[key] = self.session.client(
                    service, region_name=key[1], endpoint_url=self.endpoint_url, config=config
                )
            return self._clients[key]

    def partition(self, region: str | None = None) -> str:
        """``aws``, ``aws-us-gov`` or ``aws-cn``: regions of another partition need other credentials."""
        return str(self.session.get_partition_for_region(region or self.region))


def connect(region: str, *, profile: str | None = None, endpoint_url: str | None = None) -> Aws:
    """A session for ``region`` that has credentials, or :class:`AwsCredentialsError` saying how to give them.

    Credentials are looked up the usual boto3 way (environment, ``AWS_PROFILE``/``profile``, ~/.aws files, SSO,
    instance role); only whether some exist is checked here, the first call tells whether AWS accepts them.
    """
    boto3 = import_boto3()
    import botocore.exceptions

    try:
        session = _session(boto3, region, profile)
        credentials = session.get_credentials()
    except botocore.exceptions.ProfileNotFound as exc:
        raise AwsCredentialsError(f"AWS profile not found: {exc}", hint=CREDENTIALS_HINT) from None
    except botocore.exceptions.BotoCoreError as exc:  # a broken ~/.aws/config, an SSO session that expired, ...
        raise AwsCredentialsError(f"cannot load AWS credentials: {exc}", hint=CREDENTIALS_HINT) from None
    if credentials is None:
        raise AwsCredentialsError("no AWS credentials found", hint=CREDENTIALS_HINT)
    return Aws(session, region, endpoint_url=endpoint_url)


_LOADER_LOCK = threading.Lock()
_loader: Loader | None = None


def _session(boto3: ModuleType, region: str, profile: str | None) -> Session:
    """A new boto3 session whose botocore data loader (the AWS API models it reads and parses: several MB of JSON
    for EC2 alone) is shared by every session of this process, so the models are parsed once, not per session.
    Credentials, profile and region stay each session's own."""
    global _loader
    import botocore.loaders
    import botocore.session

    with _LOADER_LOCK:
        if _loader is None:
            _loader = botocore.loaders.create_loader()
        core = botocore.session.Session()
        core.register_component("data_loader", _loader)
        session = boto3.Session(region_name=region, profile_name=profile, botocore_session=core)
        # boto3 adds its own data folder to the loader's search path with each session: once is enough.
        _loader.search_paths[:] = list(dict.fromkeys(_loader.search_paths))
    return session


def error_code(exc: BaseException) -> str:
    """The AWS error code of a botocore ``ClientError`` (``InsufficientInstanceCapacity``), else ``""``."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def error_message(exc: BaseException) -> str:
    """The AWS error message of a botocore ``ClientError``, else ``str(exc)``."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and response.get("Error", {}).get("Message"):
        return str(response["Error"]["Message"])
    return str(exc)


def short_reason(exc: BaseException) -> str:
    """One short line for a failed call: ``"AccessDeniedException: User ... is not authorized"``, cut at 160
    characters; an HTML error page (a proxy, or a service moto does not implement) becomes its HTTP status."""
    code = error_code(exc) or type(exc).__name__
    message = error_message(exc).strip()
    if message.startswith("<") or not message:
        status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{code} (HTTP {status})" if status and str(status) != code else code
    first = message.splitlines()[0]
    return f"{code}: {first[:160]}" if first != code else code


@contextmanager
def aws_errors(doing: str, *, expected: Collection[str] = ()) -> Iterator[None]:
    """Turn AWS errors into one clear :class:`UserError`; a ``ClientError`` whose code is in ``expected`` (one
    the caller handles, e.g. ``InvalidInstanceType``) passes through unchanged.

    ``doing`` completes "... while <doing>", e.g. ``"reading the offerings of g6.12xlarge in us-east-1"``.
    """
    import botocore.exceptions

    try:
        yield
    except botocore.exceptions.NoCredentialsError:
        raise AwsCredentialsError(f"no AWS credentials found while {doing}", hint=CREDENTIALS_HINT) from None
    except botocore.exceptions.EndpointConnectionError as exc:
        raise AwsError(
            f"cannot reach AWS while {doing}: {exc}", hint="Check the network, the region and any proxy settings."
        ) from None
    except botocore.exceptions.ClientError as exc:
        code = error_code(exc)
        if code in expected:
            raise
        if code in _BAD_CREDENTIAL_CODES:
            raise AwsCredentialsError(
                f"AWS refused the credentials while {doing}: {code}: {error_message(exc)}", hint=CREDENTIALS_HINT
            ) from None
        operation = getattr(exc, "operation_name", "the call")
        if code in _DENIED_CODES:
            raise AwsError(
                f"not allowed while {doing}: {code} on {operation}: {error_message(exc)}",
                hint=f"Grant the IAM permission for {operation} to this identity "
                "(check it with `aws sts get-caller-identity`).",
            ) from None
        raise AwsError(f"AWS failed while {doing}: {short_reason(exc)} ({operation})") from exc
    except botocore.exceptions.BotoCoreError as exc:
        raise AwsError(f"AWS call failed while {doing}: {exc}") from exc
