"""OpenAI's Batch API on one replica: upload a JSONL file of requests (`/v1/files`), start a
batch (`/v1/batches`), fetch the output file when it completes.

Batch requests run through the same handlers as live ones, at a lower priority: they fill
the capacity interactive traffic leaves idle, and an interactive request that finds the
batch full preempts one of them (scheduler.py). With `--batch-dir` on a persistent volume,
a batch interrupted by a restart resumes where it stopped.
"""
