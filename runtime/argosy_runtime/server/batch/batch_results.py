"""A batch's two result files (`output.jsonl`, `errors.jsonl`), appended one line per request.

The files are the batch's progress: after a restart, the custom_ids already in them are done
and the counts and token usage are read back from them, so the runner never has to save
progress anywhere else.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class BatchResults:
    output_path: Path
    error_path: Path
    done: set[str] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, served from the prefix cache
    output_tokens: int = 0
    reasoning_tokens: int = 0  # of output_tokens, thinking (servers with --reasoning-parser)

    @staticmethod
    def paths(folder: Path, batch_id: str) -> tuple[Path, Path]:
        """The batch's output and error files."""
        return folder / f"{batch_id}.output.jsonl", folder / f"{batch_id}.errors.jsonl"

    @classmethod
    def open(cls, folder: Path, batch_id: str) -> BatchResults:
        """Read back what an earlier run of this batch finished (nothing for a new one)."""
        results = cls(*cls.paths(folder, batch_id))
        for path in (results.output_path, results.error_path):
            for record in _read_complete_lines(path):
                results._count(record)
        return results

    def add(self, custom_id: str, status_code: int, request_id: str,
            body: dict[str, Any]) -> None:
        record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                  "response": {"status_code": status_code, "request_id": request_id,
                               "body": body},
                  "error": None}
        if status_code != 200:
            error = body.get("error") if isinstance(body.get("error"), dict) else {}
            record["error"] = {"code": error.get("code") or error.get("type") or str(status_code),
                               "message": error.get("message") or f"HTTP {status_code}"}
        self._append(record)

    def add_expired(self, custom_id: str) -> None:
        self._append({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                      "response": None,
                      "error": {"code": "batch_expired",
                                "message": "the batch expired before this request ran"}})

    def _append(self, record: dict[str, Any]) -> None:
        path = self.output_path if record["error"] is None else self.error_path
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._count(record)

    def _count(self, record: dict[str, Any]) -> None:
        self.done.add(record["custom_id"])
        if record["error"] is not None:
            self.failed += 1
            return
        self.completed += 1
        usage = record["response"]["body"].get("usage") or {}
        # chat and completions say prompt/completion tokens, responses input/output tokens
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        self.input_tokens += int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
        self.cached_tokens += int(details.get("cached_tokens") or 0)
        self.output_tokens += int(usage.get("completion_tokens") or usage.get("output_tokens")
                                  or 0)
        out_details = (usage.get("completion_tokens_details") or usage.get("output_tokens_details")
                       or {})
        self.reasoning_tokens += int(out_details.get("reasoning_tokens") or 0)

    def usage(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}


def _read_complete_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a result file; a last line cut short by a crash is dropped (and cut off
    the file, so the next append starts on a fresh line)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()]
