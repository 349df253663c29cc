"""specdraft: lossless tree-verified speculative decoding for a frozen causal language model.

A drafter proposes a tree of candidate continuations, the target checks the whole tree in one
pass, and only what the target itself would have produced is kept: the output equals the
target's own plain decoding token for token.

    from specdraft import Engine, GenerateConfig
    engine = Engine.load(drafter="phrase")
    ids = engine.target.encode_prompt("What is 17 * 23?")
    print(engine.generate(ids, GenerateConfig(max_new_tokens=64)).text)

Lower level: ``Target`` (the model behind prefill / forward_tree / commit), ``make_drafter``
(the drafter registry) and ``generate`` (the loop).  The layers are listed in the README.
"""

__version__ = "0.1.0"

from specdraft.drafters import make_drafter  # noqa: E402 - after __version__, which setuptools reads
from specdraft.engine import Engine  # noqa: E402
from specdraft.generate import GenerateConfig, generate  # noqa: E402
from specdraft.target import Target  # noqa: E402

__all__ = ["Engine", "GenerateConfig", "Target", "__version__", "generate", "make_drafter"]
