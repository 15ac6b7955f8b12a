"""Write the instruction data set that ships with raytrain-eks (src/raytrain_eks/resources/).

The examples are written for this project: small, checkable tasks (arithmetic, word order, sorting, unit
conversion, counting) plus hand-written answers about distributed training on EKS. They are regular enough
for a tiny model to learn in a few minutes on a CPU, which is what the default job needs to show.

    python scripts/make_sample_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "raytrain_eks" / "resources" / "sample_instructions.jsonl"

WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "garden",
    "window",
    "bridge",
    "forest",
    "apple",
    "engine",
    "candle",
    "harbor",
    "meadow",
    "pencil",
    "rocket",
    "shadow",
    "silver",
    "tiger",
    "violin",
    "winter",
    "yellow",
    "orange",
    "planet",
    "ocean",
    "mountain",
]

NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]

FACTS = [
    (
        "What does EFA stand for?",
        "EFA stands for Elastic Fabric Adapter, a network interface for fast traffic between instances.",
    ),
    ("Can EFA traffic cross availability zones?", "No. EFA traffic stays inside one availability zone and one VPC."),
    (
        "Which transport should NCCL use between nodes on EKS?",
        "NCCL should use EFA through the aws-ofi-nccl plugin, not TCP sockets.",
    ),
    ("What happens when NCCL cannot use EFA?", "NCCL falls back to TCP sockets and the job runs, only slower."),
    ("What does FSDP shard?", "FSDP shards parameters, gradients and optimizer state across the workers."),
    ("Why train in bfloat16?", "bfloat16 halves memory and speeds up matrix math while keeping the range of float32."),
    (
        "Where does the Ray head run in the reference cluster?",
        "The Ray head runs on the system node and reserves no GPU.",
    ),
    ("How many GPUs does a g6.12xlarge have?", "A g6.12xlarge has four NVIDIA L4 GPUs."),
    ("How many EFA interfaces does a g6.12xlarge have?", "A g6.12xlarge has one EFA interface."),
    ("What runs the KubeRay operator?", "The KubeRay operator runs on the system node and manages the RayCluster."),
    (
        "How is the job submitted in the reference?",
        "The job is submitted from inside the Ray head pod with kubectl exec.",
    ),
    (
        "Why are requests equal to limits on the worker pods?",
        "Equal requests and limits give the pods Guaranteed quality of service.",
    ),
    ("What label must the GPU nodes carry?", "The GPU nodes must carry the label nvidia.com/gpu.present=true."),
    (
        "Which resource names the EFA devices of a node?",
        "The resource vpc.amazonaws.com/efa counts the EFA devices of a node.",
    ),
    ("Which resource names the GPUs of a node?", "The resource nvidia.com/gpu counts the GPUs of a node."),
    (
        "What does Ray Train do for the training function?",
        "Ray Train starts the workers, forms the process group and runs the function on each.",
    ),
    ("What is a checkpoint for?", "A checkpoint saves the model and optimizer so training can resume after a failure."),
    (
        "What is gradient accumulation?",
        "Gradient accumulation adds gradients over several micro-batches before one optimizer step.",
    ),
    ("What is a warm-up schedule?", "A warm-up raises the learning rate slowly over the first steps before it decays."),
    ("What does MFU measure?", "MFU is the share of the GPU's peak floating point rate that training actually uses."),
    (
        "Why pin one availability zone for the GPU nodes?",
        "EFA only connects instances in one zone, so all GPU nodes must share it.",
    ),
    (
        "What does NCCL_SOCKET_IFNAME do?",
        "NCCL_SOCKET_IFNAME tells NCCL which network interface to use for its sockets.",
    ),
    ("What does FI_PROVIDER=efa do?", "FI_PROVIDER=efa makes libfabric use the EFA provider."),
    ("What does NCCL_DEBUG=INFO show?", "NCCL_DEBUG=INFO makes NCCL print the transport and plugin it chose."),
    (
        "What does a NAT gateway give private subnets?",
        "A NAT gateway lets private subnets reach the internet to pull images and weights.",
    ),
    (
        "Why check the vCPU quota before creating nodes?",
        "Without enough quota the GPU instances cannot start, so check before spending money.",
    ),
    (
        "What is Ray Data used for in training?",
        "Ray Data reads, tokenizes and splits the training data across the workers.",
    ),
    (
        "What does packing do to training data?",
        "Packing joins short examples into full blocks so no compute is wasted on padding.",
    ),
    ("Why mask the prompt tokens?", "Masking the prompt makes the model learn only the answers, not the questions."),
    ("What does teardown remove?", "Teardown removes the cluster and everything else that costs money."),
]


def arithmetic(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(1, 60), rng.randint(1, 40)
    op = rng.choice(["plus", "minus", "times"])
    value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    return {"instruction": f"What is {a} {op} {b}?", "input": "", "output": f"{a} {op} {b} is {value}."}


def reverse_words(rng: random.Random) -> dict[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 5))
    return {
        "instruction": "Reverse the order of these words.",
        "input": " ".join(words),
        "output": " ".join(reversed(words)),
    }


def sort_numbers(rng: random.Random) -> dict[str, str]:
    nums = rng.sample(range(1, 100), rng.randint(3, 6))
    return {
        "instruction": "Sort these numbers from smallest to largest.",
        "input": ", ".join(map(str, nums)),
        "output": ", ".join(map(str, sorted(nums))),
    }


def capitals(rng: random.Random) -> dict[str, str]:
    words = rng.sample(WORDS, rng.randint(2, 4))
    return {
        "instruction": "Write these words in capital letters.",
        "input": " ".join(words),
        "output": " ".join(words).upper(),
    }


def count_words(rng: random.Random) -> dict[str, str]:
    n = rng.randint(2, 9)
    words = [rng.choice(WORDS) for _ in range(n)]
    return {
        "instruction": "How many words are in this text?",
        "input": " ".join(words),
        "output": f"There are {NUMBER_WORDS[n]} words.",
    }


def units(rng: random.Random) -> dict[str, str]:
    n = rng.randint(2, 20)
    kind = rng.choice(
        [
            ("kilometres", "metres", 1000),
            ("hours", "minutes", 60),
            ("kilograms", "grams", 1000),
            ("minutes", "seconds", 60),
        ]
    )
    return {
        "instruction": f"Convert {n} {kind[0]} to {kind[1]}.",
        "input": "",
        "output": f"{n} {kind[0]} is {n * kind[2]} {kind[1]}.",
    }


def main() -> None:
    rng = random.Random(20261130)
    makers = [arithmetic, reverse_words, sort_numbers, capitals, count_words, units]
    rows = [{"instruction": q, "input": "", "output": a} for q, a in FACTS]
    rows += [maker(rng) for maker in makers for _ in range(60)]
    rng.shuffle(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} examples to {OUT}")


if __name__ == "__main__":
    main()
