"""``serve_app.render_cache.NodePieceStore``: prompt pieces shared by the render processes of a machine.

Real tokenizers and a real LMDB file, a second Python process where the sharing is between processes:
ids found in the store equal the tokenizer's own, a piece is taken only when the text stored with it
is the piece, a full store empties itself and goes on, and a store that cannot open leaves the
process's own cache on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

from serve_app.render_cache import NodePieceStore, PieceCache, PrefixTokenizer

CONVERSATION = [
    {"role": "system", "content": "You are an agent. " * 30},
    {"role": "user", "content": "Fix the build, please: é\u0301 🦜 <tool_call> in text."},
    {"role": "assistant", "content": "Looking.", "reasoning_content": "First the logs."},
    {"role": "user", "content": "And the tests too.\n\n  Thanks"},
]


@pytest.fixture(scope="module")
def tok(model_dirs: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dirs["qwen3-tiny"]))


def _text(tok: Any) -> str:
    return tok.apply_chat_template(CONVERSATION, tokenize=False)


def _encoder(tok: Any, node_dir: Path, node_bytes: int = 2**24) -> PrefixTokenizer:
    encoder, why = PrefixTokenizer.for_tokenizer(tok, [tok.chat_template], node_dir=node_dir, node_bytes=node_bytes)
    assert encoder is not None and encoder.node is not None, why
    return encoder


# A second process: its own tokenizer and LRU over the same directory; prints its ids and stats.
_OTHER_PROCESS = """
import json, sys
from transformers import AutoTokenizer
from serve_app.render_cache import PrefixTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
encoder, why = PrefixTokenizer.for_tokenizer(tok, [tok.chat_template], node_dir=sys.argv[2], node_bytes=2**24)
ids = encoder.encode(sys.stdin.read())
s = encoder.cache.stats
print(json.dumps({"ids": ids, "why": why, "misses": s.misses, "node_hits": s.node_hits}))
"""


def test_a_second_process_finds_the_pieces_the_first_tokenized(tok: Any, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    text = _text(tok)
    want = tok(text, add_special_tokens=False)["input_ids"]
    first = _encoder(tok, tmp_path)
    assert first.encode(text) == want
    assert first.cache.stats.misses > 1 and first.cache.stats.node_hits == 0  # nothing stored yet
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(model_dirs["qwen3-tiny"]), str(tmp_path)],
                         input=text, capture_output=True, text=True, check=True, timeout=300)
    other = json.loads(out.stdout.strip().splitlines()[-1])
    assert other["ids"] == want
    assert "shared on this machine" in other["why"]
    assert other["misses"] == 0 and other["node_hits"] == first.cache.stats.misses  # every piece from the store


def test_a_stored_value_for_other_text_is_not_taken(tok: Any, tmp_path: Path) -> None:
    text = _text(tok)
    want = tok(text, add_special_tokens=False)["input_ids"]
    first = _encoder(tok, tmp_path)
    pieces = first.pieces(text)
    store = first.node
    assert store is not None
    # Under each piece's key, ids stored with a different text (a digest collision, or a stale writer).
    import lmdb  # noqa: F401 - the store's own library

    with store._env.begin(write=True) as txn:
        for piece in pieces:
            raw = piece.encode()
            other = raw[:-1] + b"?" if raw else b"?"
            txn.put(store._key(raw), len(other).to_bytes(4, "little") + other + array("I", [7] * 3).tobytes())
    cold = PrefixTokenizer(first.backend, first.cuts, PieceCache(), store)
    assert cold.encode(text) == want
    assert cold.cache.stats.node_hits == 0 and cold.cache.stats.misses == len(pieces)
    # The pieces were tokenized and stored again, correctly this time: a third LRU takes them from the store.
    again = PrefixTokenizer(first.backend, first.cuts, PieceCache(), store)
    assert again.encode(text) == want and again.cache.stats.misses == 0


def test_a_stored_value_with_torn_ids_is_not_taken(tok: Any, tmp_path: Path) -> None:
    text = _text(tok)
    first = _encoder(tok, tmp_path)
    first.encode(text)
    store = first.node
    assert store is not None
    with store._env.begin(write=True) as txn:  # each piece's right text, then ids one byte short
        for piece in first.pieces(text):
            raw = piece.encode()
            txn.put(store._key(raw), len(raw).to_bytes(4, "little") + raw + b"\x01\x02\x03")
    cold = PrefixTokenizer(first.backend, first.cuts, PieceCache(), store)
    assert cold.encode(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert cold.cache.stats.node_hits == 0 and store.broken is None


def test_a_full_store_empties_itself_and_goes_on(tmp_path: Path) -> None:
    store, why = NodePieceStore.open(tmp_path, "tiny", 2**20)
    assert store is not None, why
    batch = {f"piece {i} " * 20: array("I", range(i, i + 500)) for i in range(40)}  # ~100 kB a batch
    for round_ in range(30):  # ~3 MB in all into a 1 MB map
        store.put_many({f"{round_}:{k}": v for k, v in batch.items()})
    assert store.broken is None
    last = {f"29:{k}": v for k, v in batch.items()}
    assert store.get_many(list(last)) == last  # the newest batch is there, intact
    assert store._env.stat()["entries"] < 30 * len(batch)  # older ones went when the map filled


def test_a_store_that_cannot_open_leaves_the_process_cache_on(tok: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    encoder, why = PrefixTokenizer.for_tokenizer(tok, [tok.chat_template], node_dir=blocker, node_bytes=2**24)
    assert encoder is not None and encoder.node is None
    assert "not shared on this machine" in why and str(blocker) in why
    text = _text(tok)
    assert encoder.encode(text) == tok(text, add_special_tokens=False)["input_ids"]


def test_one_store_per_directory_in_a_process(tok: Any, tmp_path: Path) -> None:
    a, b = _encoder(tok, tmp_path), _encoder(tok, tmp_path)
    assert a.node is b.node  # LMDB opens an environment once per process
    assert a.cache is not b.cache


def test_no_store_without_a_directory_or_size(tok: Any, tmp_path: Path) -> None:
    for node_dir, node_bytes in ((None, 2**24), (tmp_path, 0)):
        encoder, why = PrefixTokenizer.for_tokenizer(tok, [tok.chat_template], node_dir=node_dir, node_bytes=node_bytes)
        assert encoder is not None and encoder.node is None and "shared" not in why
