"""``specdraft chat``: piped conversations on the tiny chat model, one on the real default target."""

from __future__ import annotations

import io
import re
import sys

from specdraft import cli
from specdraft.chat import ChatSession, LiveStatus, run_chat
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.generate import GenerateConfig, generate
from specdraft.engine import Engine


def greedy(target, messages, n):
    return generate(target, target.encode_messages(messages), NoDrafter(), GenerateConfig(max_new_tokens=n)).text


def chat(target, lines: str, n: int = 10, drafter=None, system=None, quiet=False):
    session = ChatSession(Engine(target, drafter or NgramDrafter()), GenerateConfig(max_new_tokens=n), system=system)
    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(session, stdin=io.StringIO(lines), stdout=out, stderr=err, quiet=quiet)
    return rc, out.getvalue(), err.getvalue(), session


def test_conversation_keeps_history_and_resets(tiny_chat_target):
    t = tiny_chat_target
    rc, out, err, session = chat(t, "Hello\n\nHow are you?\n/reset\nHi again\n", system="Be brief.")
    sys_turn = [{"role": "system", "content": "Be brief."}]
    r1 = greedy(t, sys_turn + [{"role": "user", "content": "Hello"}], 10)
    r2 = greedy(t, sys_turn + [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": r1},
                               {"role": "user", "content": "How are you?"}], 10)
    r3 = greedy(t, sys_turn + [{"role": "user", "content": "Hi again"}], 10)
    assert rc == 0
    assert out == f"{r1}\n{r2}\n{r3}\n"
    assert err.count("tokens/pass") == 3 and "(conversation reset)" in err
    assert session.messages == sys_turn + [{"role": "user", "content": "Hi again"}, {"role": "assistant", "content": r3}]


def test_exit_help_unknown_and_quiet(tiny_chat_target):
    rc, out, err, _ = chat(tiny_chat_target, "/help\n/what\nOne\n/exit\nnever answered\n", quiet=True)
    assert rc == 0
    assert out.count("\n") == 1  # one reply, nothing after /exit
    assert "/reset" in err and "unknown command /what" in err and "tokens/pass" not in err
    rc, out, err, _ = chat(tiny_chat_target, "")  # end of input at once
    assert (rc, out) == (0, "")


def test_interrupted_reply_is_forgotten(tiny_chat_target):
    class Interrupting(NoDrafter):
        calls = 0

        def propose(self, budget):
            Interrupting.calls += 1
            if Interrupting.calls == 2:
                raise KeyboardInterrupt
            return super().propose(budget)

    rc, out, err, session = chat(tiny_chat_target, "First\nSecond\n", drafter=Interrupting())
    assert rc == 0 and "(reply interrupted)" in err
    r2 = greedy(tiny_chat_target, [{"role": "user", "content": "Second"}], 10)
    assert out.endswith(f"{r2}\n")
    assert [m["content"] for m in session.messages] == ["Second", r2]


def test_old_turns_dropped_to_fit_the_context(tiny_chat_target):
    long = " ".join(["word"] * 70)  # ~70 tokens per turn; the tiny model's context is 256
    rc, out, err, session = chat(tiny_chat_target, "".join(f"{i} {long}\n" for i in range(4)), n=8)
    assert rc == 0 and out.count("\n") >= 4
    assert "were dropped" in err
    assert len(tiny_chat_target.encode_messages(session.messages)) < 256
    rc, out, err, session = chat(tiny_chat_target, " ".join(["word"] * 400) + "\nshort\n", n=4)
    assert "error:" in err and "context" in err
    assert [m["content"] for m in session.messages][0] == "short"


def test_live_status_is_written_then_erased():
    buf = io.StringIO()
    live = LiveStatus(buf, enabled=True, width=40)
    live.text("Hello")
    live.status(" [9.0 tok/s]")
    live.text(" world")
    live.end()
    assert buf.getvalue() == "Hello\x1b[2m [9.0 tok/s]\x1b[0m\x1b[12D\x1b[K world"
    live.text("x" * 25)  # column 36 of 40: a status there would wrap, so none is written
    before = buf.getvalue()
    live.status(" [9.0 tok/s]")
    assert buf.getvalue() == before
    off = io.StringIO()
    quiet = LiveStatus(off, enabled=False)
    quiet.text("a")
    quiet.status(" [1 tok/s]")
    assert off.getvalue() == "a"


def test_cli_chat_piped_on_default_target(monkeypatch, capsys, default_target):
    from specdraft.target import Target

    loaded = []  # the session's weights instead of loading the GGUF again
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, spec, **kw: loaded.append((spec, kw)) or Target(
        default_target.model, default_target.tokenizer, default_target.name, default_target.weight_hash)))
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2+2?\n"))
    rc = cli.main(["chat", "--max-new-tokens", "12"])
    cap = capsys.readouterr()
    assert rc == 0
    assert cap.out == greedy(default_target, [{"role": "user", "content": "What is 2+2?"}], 12) + "\n"
    # the default drafter is `auto`: phrase, whose shipped weights fit the default target
    assert re.search(r"\[phrase\] \d+ tokens, [\d.]+ tok/s, [\d.]+ tokens/pass", cap.err)
    assert loaded == [("default", {"device": "cpu", "dtype": "float32", "precision": None})]
