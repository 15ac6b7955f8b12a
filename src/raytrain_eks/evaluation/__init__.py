"""Benchmark evaluation of a trained model with EleutherAI's lm-evaluation-harness: ``harness`` (lm-eval's tasks,
one worker's scores, the merge), ``run`` (the model a folder holds, the workers, ``eval.json``)."""
