"""`--lora-modules-file`: the adapters to serve, in a file the server re-reads while it runs.

The file is a JSON object `{"adapter-name": "/path/to/peft/folder", ...}` (the format of
`--lora-modules`). The operator writes it into a ConfigMap mounted into every runtime pod, so
adding or removing an adapter in an LLMDeployment patches the ConfigMap instead of the pod
template: no rollout, no cold start; kubelet refreshes the mounted file within about a minute
and the next `sync` applies it.

`sync` makes the served adapters match the file: new names are loaded, a name whose path
changed is loaded again, names gone from the file are unloaded. It only ever unloads adapters
it loaded itself (not `--lora-modules` ones). A broken file or adapter is logged and leaves
everything else serving; a failed adapter is retried at every sync (its folder may still be
syncing onto a volume), with the error logged once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("argosy.lora")

# How often the server calls `sync` (kubelet's ConfigMap refresh is ~1 minute anyway).
POLL_SECONDS = 5.0


def read_modules_file(path: str | Path) -> dict[str, str]:
    """The {name: folder} mapping in `path`; ValueError saying what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"lora_modules_file: cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_modules_file: {path} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise ValueError(f"lora_modules_file: {path} must hold a JSON object of "
                         '{"adapter-name": "/adapter/folder"}')
    return data


class LoRAModulesFile:
    """Keeps an engine's adapters in step with one modules file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.applied: dict[str, str] = {}  # name -> folder, loaded from this file
        self._failed: dict[str, str] = {}  # name -> the error last logged for it
        self._file_error: str | None = None

    def sync(self, engine: Any) -> bool:
        """Apply the file to `engine` (load_lora_adapter / unload_lora_adapter); True when
        the served adapters changed."""
        try:
            wanted = read_modules_file(self.path)
        except ValueError as exc:
            if str(exc) != self._file_error:  # log a broken file once, not every poll
                logger.error("%s; keeping the adapters served now", exc)
                self._file_error = str(exc)
            return False
        self._file_error = None
        changed = False
        for name in [n for n in self.applied if n not in wanted]:
            del self.applied[name]
            if name in engine.lora_paths:  # registered (loaded or not)
                engine.unload_lora_adapter(name)
                changed = True
        for name, folder in wanted.items():
            if self.applied.get(name) == folder:
                continue
            try:
                engine.load_lora_adapter(name, folder)
            except (ValueError, OSError) as exc:
                if self._failed.get(name) != str(exc):
                    logger.error("LoRA adapter %s from %s not loaded: %s", name, self.path, exc)
                    self._failed[name] = str(exc)
                continue
            self._failed.pop(name, None)
            self.applied[name] = folder
            changed = True
        for name in [n for n in self._failed if n not in wanted]:
            del self._failed[name]
        return changed
