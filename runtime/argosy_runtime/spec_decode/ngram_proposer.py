"""N-gram prompt lookup: propose what followed the last occurrence of the current suffix.

No extra model: for input-grounded tasks (editing, extraction, code changes) the answer
repeats long spans of the prompt, and those spans are found by matching the last n tokens.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens following the most recent earlier match of the longest suffix n-gram."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            pattern = tokens[length - n :]
            # Windows starting at 0 .. length - n - 1 (excluding the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            matches = np.flatnonzero((windows == pattern).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start : start + k].tolist()
        return []
