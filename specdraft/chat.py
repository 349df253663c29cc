"""``specdraft chat``: an interactive terminal chat over the target and a drafter.

Each reply streams as it is accepted.  On a terminal a dim status after the text shows the live
tok/s and tokens per pass; after every reply one stats line goes to stderr.  The whole
conversation is sent through the target's chat template each turn.  Commands: ``/reset``
(forget the conversation), ``/exit`` (or ``/quit``, or end of input), ``/help``.  Ctrl-C during
a reply stops that reply; at the prompt it exits.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
import unicodedata
from typing import TextIO

from specdraft.engine import Cancelled, Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, GenerationResult

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D), /help"


class LiveStatus:
    """Streams text to ``out`` and, on a terminal, keeps a dim status right after the last
    character (erased before the next text), only when it fits on the current line."""

    def __init__(self, out: TextIO, enabled: bool, width: int = 80) -> None:
        self.out, self.enabled, self.width = out, enabled, width
        self.col = 0  # cursor column, tracked from the text written
        self.shown = 0  # characters of status after the cursor

    def _clear(self) -> None:
        if self.shown:
            self.out.write("\x1b[K")
            self.shown = 0

    def text(self, s: str) -> None:
        self._clear()
        self.out.write(s)
        for ch in s:
            if ch == "\n" or ch == "\r":
                self.col = 0
            elif ch == "\t":
                self.col += 8 - self.col % 8
            elif not unicodedata.combining(ch):
                self.col += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
            if self.col >= self.width:
                self.col -= self.width
        self.out.flush()

    def status(self, msg: str) -> None:
        if not self.enabled:
            return
        self._clear()
        if self.col + len(msg) + 4 < self.width:  # never wrap: the cursor must come back on this line
            self.out.write(f"\x1b[2m{msg}\x1b[0m\x1b[{len(msg)}D")
            self.shown = len(msg)
        self.out.flush()

    def end(self) -> None:
        self._clear()
        self.out.flush()


class ChatSession:
    """The conversation and one reply at a time (usable without a terminal, e.g. in tests)."""

    def __init__(self, engine: Engine, config: GenerateConfig, system: str | None = None) -> None:
        self.engine, self.config, self.system = engine, config, system
        self.target, self.drafter = engine.target, engine.drafter
        self.messages: list[dict] = []
        self.dropped = 0  # turns dropped from the last prompt to fit the context
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> tuple[list[int], int]:
        """The conversation's ids; the oldest turns are dropped while it does not fit the context."""
        ctx = self.target.config.max_position
        dropped = 0
        while True:
            ids = self.target.encode_messages(self.messages)
            if len(ids) + min(self.config.max_new_tokens, 16) < ctx:
                return ids, dropped
            first = 1 if self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:
                raise SpecdraftError(f"the message is {len(ids)} tokens; the model's context is {ctx} tokens")
            del self.messages[first : first + 2]  # one user turn and its reply
            dropped += 1

    def reply(self, user: str, out: LiveStatus, cancel: threading.Event | None = None) -> GenerationResult:
        self.messages.append({"role": "user", "content": user})
        try:
            ids, self.dropped = self.prompt_ids()
        except SpecdraftError:
            self.messages.pop()
            raise
        t0 = time.perf_counter()
        counts = {"tokens": 1, "passes": 0}  # the first token comes from prefill

        def on_pass(n: int) -> None:
            counts["tokens"] += n
            counts["passes"] += 1
            dt = time.perf_counter() - t0
            out.status(f" [{counts['tokens'] / dt:.1f} tok/s, {(counts['tokens'] - 1) / counts['passes']:.2f} tok/pass]")

        try:
            r = self.engine.generate(ids, self.config, on_text=out.text, cancel=cancel, on_pass=on_pass)
        except BaseException:
            self.messages.pop()  # an interrupted turn is forgotten
            raise
        finally:
            out.end()
        self.messages.append({"role": "assistant", "content": r.text})
        return r


def stats_line(r: GenerationResult, drafter: str) -> str:
    st = r.stats
    return (f"[{drafter}] {st.new_tokens} tokens, {st.tok_s:.1f} tok/s, {st.tokens_per_pass:.2f} tokens/pass "
            f"({st.passes} passes), finish: {r.finish_reason}")


def run_chat(session: ChatSession, stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None, quiet: bool = False) -> int:
    """The read-reply loop (standard streams by default); returns when the input ends or on /exit."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    tty = stdin.isatty() and stdout.isatty()
    width = 80
    if tty:
        width = shutil.get_terminal_size().columns
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        print(f"chatting with {session.target.name} ({session.drafter.name} drafter). {HELP}", file=stderr)
    live = LiveStatus(stdout, enabled=tty and not quiet, width=width)
    while True:
        try:
            if tty:
                line = input("\n\x1b[1myou>\x1b[0m ")
            else:
                line = stdin.readline()
                if not line:
                    raise EOFError
        except (EOFError, KeyboardInterrupt):
            if tty:
                print(file=stdout)
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd = line.split()[0].lower()
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/reset":
                session.reset()
                print("(conversation reset)", file=stderr)
            else:
                print(HELP if cmd == "/help" else f"unknown command {cmd}; {HELP}", file=stderr)
            continue
        if tty:
            stdout.write("\x1b[1massistant>\x1b[0m ")
        live.col = len("assistant> ") if tty else 0
        try:
            r = session.reply(line, live)
        except KeyboardInterrupt:
            print("\n(reply interrupted)", file=stderr)
            continue
        except (SpecdraftError, Cancelled) as e:
            print(f"error: {e}", file=stderr)
            continue
        stdout.write("\n")
        stdout.flush()
        if session.dropped:
            print(f"(the {session.dropped} oldest turn(s) no longer fit the context and were dropped)", file=stderr)
        if not quiet:
            print(stats_line(r, session.drafter.name), file=stderr)
