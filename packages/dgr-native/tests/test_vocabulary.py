"""The tokenizer without weights: a vocab_only load gives the same tokens, text, end-of-generation
ids and chat template as a stage of the model, holds no weights, and refuses a corrupt vocabulary
with a typed error instead of letting llama.cpp abort."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dgr_native import load
from dgr_prd.paths import find_root

TEXTS = ["Hello, world!", "Привет, мир", "你好 🌍 ok", "  spaced   out  ", ""]


def test_same_tokenizer_as_a_stage(smollm2: Path) -> None:
    m = load()
    vocab = m.Vocabulary(str(smollm2))
    stage = m.Engine(str(smollm2), 0, 1, n_ctx=16, n_batch=8, max_sessions=1)
    assert vocab.n_vocab == stage.describe()["n_vocab"]
    for text in TEXTS:
        for special in (True, False):
            tokens = vocab.tokenize(text, special)
            assert tokens == stage.tokenize(text, special)
            assert vocab.detokenize(tokens) == stage.detokenize(tokens)
    eog = [t for t in range(vocab.n_vocab) if vocab.is_eog(t)]
    assert eog and eog == [t for t in range(vocab.n_vocab) if stage.is_eog(t)]
    chat = [("system", "Be brief."), ("user", "Hi")]
    assert vocab.apply_chat_template(chat, True) == stage.apply_chat_template(chat, True)
    with pytest.raises(m.ShardError) as bad:
        vocab.detokenize([vocab.n_vocab])
    assert bad.value.status == "invalid_argument"


PROBE = """
import json, sys
from dgr_native import load
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
m = load(); before = rss()
v = m.Vocabulary(sys.argv[1]); vocab = rss() - before
e = m.Engine(sys.argv[1], 0, -1, n_ctx=16, n_batch=8, max_sessions=1); engine = rss() - before
print(json.dumps({"vocab": vocab, "engine": engine}))
"""


def test_no_weights_are_loaded(smollm2: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(smollm2)], capture_output=True, text=True, check=True
    )
    grew = json.loads(out.stdout.strip().splitlines()[-1])
    # the whole model's weights are ~90 MiB of Q4_1: the vocabulary alone is a fraction of that
    assert grew["vocab"] < 0.25 * grew["engine"], grew


def test_a_corrupt_vocabulary_is_refused(tmp_path: Path) -> None:
    m = load()
    corpus = find_root().root / "native" / "fuzz" / "corpus" / "gguf"
    regression = corpus / "regression-duplicate-token"
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(regression.read_bytes()[1:])  # a fuzz input's first byte picks a range
    with pytest.raises(m.ShardError) as bad:
        m.Vocabulary(str(corrupt))
    assert bad.value.status == "load_failed" and "repeats an earlier token" in str(bad.value)
    with pytest.raises(m.ShardError) as missing:
        m.Vocabulary("/nonexistent/model.gguf")
    assert missing.value.status == "load_failed"
