"""What the `minite` commands show on the terminal, and where everything else goes.

Quiet by default: the terminal gets miniTE's own warnings and errors, INFO records that a caller marked for it
(`log.info(..., extra=CONSOLE)`: one line such as "initial weights from DIR"), any library's ERROR records, and what
the commands print themselves (a header, the progress bar, a summary). Everything else (INFO dumps and upstream
warnings such as Megatron-Core's "Transformer Engine / Apex not installed" UserWarnings, which `captureWarnings`
turns into records of the `py.warnings` logger) goes only to the run's log file (`attach_log_file`). `-v` shows
every record on the terminal too.

Terminal records are written through tqdm.write, so a log line never glues itself to a progress bar that is being
drawn on the same stream.

Ctrl-C is never lost (`catch_interrupts`, `raise_if_interrupted`): Python raises its KeyboardInterrupt wherever the
main thread happens to be, and there it can vanish: inside a bare `except:` (Megatron-Core guards optional imports
so) or a destructor (Python prints "Exception ignored" and goes on). The run then went on to its end (`minite train`
exited 0 after a SIGINT once, on a loaded machine); now it stops at its next step.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from tqdm import tqdm

CONSOLE = {"console": True}
"""`extra=` for an INFO record that belongs on the terminal even when quiet."""
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _TerminalFilter(logging.Filter):
    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose or record.levelno >= logging.ERROR:
            return True
        if not record.name.startswith("minite"):
            return False
        return record.levelno >= logging.WARNING or bool(getattr(record, "console", False))


class _TerminalFormatter(logging.Formatter):
    """Quiet: the bare message, prefixed by the level for warnings and errors. Verbose: the log file's format."""

    def __init__(self, verbose: bool):
        super().__init__(FILE_FORMAT if verbose else "%(message)s")
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not self.verbose and record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        return text


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's contract: report through handleError, never raise
            self.handleError(record)


def _replace(handler: logging.Handler, kind: type) -> None:
    """Install `handler` on the root logger in place of an earlier one of this module's `kind` (a command run twice
    in one process, as tests do, must not print or write twice); other handlers, e.g. pytest's, stay."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if type(h) is kind]:
        root.removeHandler(h)
        h.close()
    root.addHandler(handler)


class _RunLogHandler(logging.FileHandler):
    """The run's log file (a type of its own, so that _replace finds it)."""


def configure(verbose: bool = False) -> None:
    """The terminal handler on the root logger, level MINITE_LOG_LEVEL (default INFO)."""
    root = logging.getLogger()
    handler = _TqdmHandler()
    handler.addFilter(_TerminalFilter(verbose))
    handler.setFormatter(_TerminalFormatter(verbose))
    _replace(handler, _TqdmHandler)
    root.setLevel(os.environ.get("MINITE_LOG_LEVEL", "INFO"))
    logging.captureWarnings(True)


def attach_log_file(path: str | Path) -> Path:
    """Append every record (all loggers, warnings included) to `path` from now on; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _RunLogHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    _replace(handler, _RunLogHandler)
    return path


def one_line(text: str) -> str:
    """A message folded onto one line (an error message may carry newlines from upstream)."""
    return " ".join(str(text).split())


_interrupted = False


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def catch_interrupts() -> None:
    """Remember every Ctrl-C (SIGINT) of this process as well as raise KeyboardInterrupt for it as Python does, so
    that one swallowed by a library's bare `except:` still stops the run at its next `raise_if_interrupted`. Only
    from the main thread (where Python runs signal handlers); elsewhere a no-op."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a Ctrl-C arrived since `catch_interrupts` (a long job calls this between its steps)."""
    if _interrupted:
        raise KeyboardInterrupt
