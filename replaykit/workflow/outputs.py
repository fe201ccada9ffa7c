"""What a notebook showed: each execution's outputs, recorded in the kernel as they are sent, and
read back from the saved notebook, digested the same way both times, so the seal covers them.

    outputs.start()                  # the bootstrap does this: from the next execution on
    outputs.covered(shell)           # the seal's "outputs": {"from": k, "digests": [...]}
    outputs.digest(cell.outputs)     # at check time, the same digest from the saved notebook

A digest covers what a reader can take as a result: stream text (stdout and stderr, each
concatenated; a ``\\r`` overwrite kept as a terminal shows it), and every ``display_data`` and
``execute_result`` in the types of ``COVERED`` (text, Markdown, HTML, LaTeX, SVG, JSON; PNG, JPEG
and GIF as their decoded bytes). Errors are judged apart (a failed cell is never a pass); widget
views and types outside ``COVERED`` are left out, since front ends differ in what they keep.
Standard library only: the bootstrap starts the recorder before replaykit's dependencies exist.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import sys
from typing import Any

__all__ = ["COVERED", "Recorder", "covered", "current", "digest", "start"]

BINARY = ("image/png", "image/jpeg", "image/gif")
COVERED = ("text/plain", "text/markdown", "text/html", "text/latex", "image/svg+xml", *BINARY)
"""The output types the seal covers, besides stream text; ``*json`` types are covered as well."""


def _joined(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _line(line: str) -> str:
    """A line as a terminal shows it: what follows the last carriage return, trailing blanks off."""
    line = line.rstrip("\r")
    return line.rsplit("\r", 1)[-1].rstrip()


def text(value: Any) -> str:
    """Text as compared: carriage returns applied, trailing blanks and blank end lines dropped."""
    return "\n".join(_line(line) for line in _joined(value).split("\n")).rstrip("\n")


def _value(mime: str, value: Any) -> str:
    """sha256 of one output value: images by their bytes, JSON canonical, text normalised."""
    if mime in BINARY:
        if isinstance(value, (bytes, bytearray)):
            raw = bytes(value)
        else:
            try:
                raw = base64.b64decode("".join(_joined(value).split()), validate=True)
            except (binascii.Error, ValueError):
                raw = _joined(value).encode()
        return hashlib.sha256(raw).hexdigest()
    if mime.endswith("json"):
        body = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(body.encode()).hexdigest()
    return hashlib.sha256(text(value).encode()).hexdigest()


def _covered_mime(mime: str) -> bool:
    return mime in COVERED or (mime.endswith("json") and "widget" not in mime)


def digest(outputs: list[Any]) -> str:
    """sha256 over one execution's outputs (nbformat dicts, as saved or as recorded)."""
    streams: dict[str, str] = {}
    shown = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            name = str(out.get("name", "stdout"))
            streams[name] = streams.get(name, "") + _joined(out.get("text", ""))
        elif kind in ("display_data", "execute_result"):
            data = out.get("data") or {}
            values = {m: _value(m, v) for m, v in sorted(data.items()) if _covered_mime(m)}
            if values:
                shown.append(values)
    body = {"streams": {k: text(v) for k, v in sorted(streams.items()) if text(v)}, "shown": shown}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Recorder:
    """Each execution's outputs, as the front end receives them (see ``start``)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.first = self.count()
        """The execution that started it: its earlier outputs were sent before, so it is not covered."""
        self.by_count: dict[int, list[dict[str, Any]]] = {}
        self._clear_pending = False
        self._ids: dict[str, list[dict[str, Any]]] = {}

    def count(self) -> int:
        """The running execution's number (``In[n]``): the cells stored in history so far. (IPython
        9 raises ``execution_count`` before a cell's outputs are sent; history is the seal's too.)"""
        return len(self.shell.history_manager.input_hist_raw) - 1

    def _add(self, out: dict[str, Any]) -> None:
        count = self.count()
        if self._clear_pending:
            self.by_count[count] = []
            self._clear_pending = False
        self.by_count.setdefault(count, []).append(out)

    def stream(self, name: str, chunk: Any) -> None:
        if isinstance(chunk, str) and chunk:
            self._add({"output_type": "stream", "name": name, "text": chunk})

    def display(self, data: Any, transient: Any = None, update: bool = False) -> None:
        """A display; an update of a ``display_id`` replaces what that id showed, where it showed it."""
        display_id = (transient or {}).get("display_id") if isinstance(transient, dict) else None
        if update and display_id:
            for out in self._ids.get(display_id, []):
                out["data"] = dict(data or {})
            return
        out = {"output_type": "display_data", "data": dict(data or {})}
        self._add(out)
        if display_id:
            self._ids.setdefault(display_id, []).append(out)

    def result(self, data: Any) -> None:
        self._add({"output_type": "execute_result", "data": dict(data or {})})

    def clear(self, wait: bool = False) -> None:
        if wait:
            self._clear_pending = True
        else:
            self.by_count[self.count()] = []

    def covered(self) -> dict[str, Any]:
        """``{"from": k, "digests": [...]}``: the digests of executions k .. now (now: so far)."""
        now = self.count()
        start = self.first + 1
        return {
            "from": start,
            "digests": [digest(self.by_count.get(c, [])) for c in range(start, now + 1)],
        }


_recorders: dict[int, Recorder] = {}


def current(shell: Any) -> Recorder | None:
    """The recorder started in ``shell``, or None."""
    return _recorders.get(id(shell)) if shell is not None else None


def _wrap_streams(recorder: Recorder) -> None:
    """Wrap ``sys.stdout``/``sys.stderr``'s ``write`` unless wrapped: before every cell, since
    IPython 9 patches ``write`` per cell and puts back what it found."""
    for stream in (sys.stdout, sys.stderr):
        name = getattr(stream, "name", None)
        original = getattr(stream, "write", None)
        if name not in ("stdout", "stderr") or getattr(original, "_replaykit_outputs", False):
            continue

        def write(chunk: Any, *args: Any, _name: str = name, _write: Any = original) -> Any:
            recorder.stream(_name, chunk)
            return _write(chunk, *args)

        write._replaykit_outputs = True  # type: ignore[attr-defined]
        try:
            stream.write = write
        except AttributeError:  # a stream that takes no attributes: its text is not recorded
            continue


def _wrap_display(shell: Any, recorder: Recorder) -> None:
    pub = shell.display_pub
    publish, clear = pub.publish, pub.clear_output

    def publish_recorded(*args: Any, **kwargs: Any) -> Any:
        data = kwargs.get("data", args[0] if args else None)
        recorder.display(data, kwargs.get("transient"), bool(kwargs.get("update", False)))
        return publish(*args, **kwargs)

    def clear_recorded(*args: Any, **kwargs: Any) -> Any:
        recorder.clear(bool(kwargs.get("wait", args[0] if args else False)))
        return clear(*args, **kwargs)

    pub.publish, pub.clear_output = publish_recorded, clear_recorded
    hook = shell.displayhook
    write_format_data = hook.write_format_data

    def result_recorded(format_dict: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.result(format_dict)
        return write_format_data(format_dict, *args, **kwargs)

    hook.write_format_data = result_recorded


def start(shell: Any = None) -> Recorder | None:
    """Record every output the kernel sends from the next execution on (idempotent); None outside
    an IPython kernel. The streams, the display publisher and the display hook are wrapped on their
    instances: what they send is unchanged."""
    if shell is None:
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "display_pub"):
        return None
    if (found := current(shell)) is not None:
        return found
    recorder = Recorder(shell)
    _wrap_display(shell, recorder)
    _wrap_streams(recorder)
    shell.events.register("pre_run_cell", lambda *_: _wrap_streams(recorder))
    _recorders[id(shell)] = recorder
    return recorder


def covered(shell: Any) -> dict[str, Any]:
    """What the seal stores: the recorder's digests, or (none started) nothing covered yet."""
    recorder = current(shell) or start(shell)
    if recorder is None:
        return {"from": None, "digests": []}
    return recorder.covered()
