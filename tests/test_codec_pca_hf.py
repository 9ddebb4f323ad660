"""The PCA codec's calibration inputs from a Hugging Face model (`lmtier.codec.pca.hf`): on SmolLM2 the
canonical KV is the model's cache bit for bit, the inverse frequencies are RoPE's (and vLLM's), the
metric is the block-diagonal PSD matrix of the queries' second moments (K) and the output projection's
Gram matrix (V); llama3 scaling is taken from the model; every unsupported input is refused by name."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from lmtier.codec.pca import hf as PH
from lmtier.errors import LMTierError
from lmtier.testing.vllm import MODEL_DIR, require_vllm

needs_model = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").exists(), reason=f"SmolLM2-135M not present in {MODEL_DIR}"
)
LONG = "KV caches are stored in tiers: GPU memory, host memory, local disk and remote stores. " * 12
SHORT = "A short second text."
MAX_TOKENS = 96
L, H, D, NQ = 30, 3, 64, 9  # SmolLM2-135M: layers, KV heads, head size, query heads


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.skip(f"SmolLM2-135M not present in {MODEL_DIR}")
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def cal():
    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.skip(f"SmolLM2-135M not present in {MODEL_DIR}")
    return PH.collect(MODEL_DIR, [LONG, SHORT], max_tokens=MAX_TOKENS)


def _ids(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok(text).input_ids[:MAX_TOKENS], dtype=torch.int64)


def _tiny(**kw):
    """A random 2-layer Llama (4 query heads, 2 KV heads of 8) built in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    args = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    args.update(num_key_value_heads=2, vocab_size=100, max_position_embeddings=512)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**args, **kw})).eval()


def _word_tokenizer():
    """A fast tokenizer of 100 words ``w0 .. w98`` and ``[UNK]``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(99)} | {"[UNK]": 99}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def save_tiny_checkpoint(d):
    """Write a checkpoint of :func:`_tiny` and :func:`_word_tokenizer` (~100 kB) to ``d``; returns ``d``."""
    _tiny().save_pretrained(d)
    _word_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


WORDS = " ".join(f"w{i % 99}" for i in range(40))


LLAMA3 = dict(
    rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)  # fmt: skip


@needs_model
def test_kv_is_the_models_cache_bit_for_bit(cal, smol):
    model, tok = smol
    assert cal.model_name == "SmolLM2-135M-Instruct" and len(cal.kv) == 2
    n_short = len(tok(SHORT).input_ids)
    assert 2 <= n_short < MAX_TOKENS < len(tok(LONG).input_ids)
    assert [tuple(kv.shape) for kv in cal.kv] == [(L, 2, MAX_TOKENS, H, D), (L, 2, n_short, H, D)]
    assert all(kv.dtype == torch.bfloat16 and kv.device.type == "cpu" for kv in cal.kv)
    for text, kv in zip((LONG, SHORT), cal.kv):
        with torch.no_grad():
            cache = model(_ids(tok, text)[None], use_cache=True).past_key_values
        for l, layer in enumerate(cache.layers):  # HF [1, H, T, D] -> [T, H, D]
            k, v = (x[0].transpose(0, 1).to(torch.bfloat16) for x in (layer.keys, layer.values))
            assert torch.equal(kv[l, 0].view(torch.int16), k.view(torch.int16))
            assert torch.equal(kv[l, 1].view(torch.int16), v.view(torch.int16))


@needs_model
def test_inv_freq_is_ropes_of_the_config(cal, smol):
    model, _ = smol
    theta = model.config.rope_parameters["rope_theta"]
    ref = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    assert cal.inv_freq.dtype == np.float64 and cal.inv_freq.shape == (D // 2,)
    np.testing.assert_allclose(cal.inv_freq, ref, rtol=2**-22, atol=0)  # 2 float32 ulps: HF's float32 buffer
    assert np.array_equal(cal.inv_freq, PH.rotary_inv_freq(model))


@needs_model
def test_metric_is_block_diagonal_psd_from_queries_and_output_projection(cal, smol):
    model, tok = smol
    m = cal.metric
    assert m.shape == (L, 2, H * D, H * D) and m.dtype == torch.float64
    assert torch.equal(m, m.transpose(-1, -2))
    eig = torch.linalg.eigvalsh(m)
    assert bool((eig[:, 0] > 0).all()) and bool((eig[:, 1] > 0).all())  # K: positive queries; V: full rank
    for h in range(H):  # zero off the KV head's diagonal block
        blk = m[..., h * D : (h + 1) * D, :].clone()
        blk[..., h * D : (h + 1) * D] = 0
        assert not blk.any()
    k = m[:, 0]
    assert torch.equal(k, torch.diag_embed(torch.diagonal(k, dim1=-2, dim2=-1)))
    dk = torch.diagonal(k, dim1=-2, dim2=-1).reshape(L, H, 2, D // 2)
    assert torch.equal(dk[:, :, 0], dk[:, :, 1])  # RoPE pair (i, i + D/2) averaged
    # independently: queries of layer 7 from the hidden states, query heads 3-5 share KV head 1
    ids = [_ids(tok, LONG), _ids(tok, SHORT)]
    attn, q2 = model.model.layers[7].self_attn, []
    with torch.no_grad():
        for x in ids:
            hidden = model(x[None], output_hidden_states=True).hidden_states[7][0]
            q2.append(attn.q_proj(model.model.layers[7].input_layernorm(hidden)).double().reshape(-1, NQ, D) ** 2)
    q2 = torch.cat(q2).mean(0)[3:6].sum(0)
    ref = (q2 + q2.roll(D // 2)) / 2
    assert torch.allclose(torch.diagonal(k[7, D : 2 * D, D : 2 * D]), ref, rtol=1e-9, atol=0)
    wo = attn.o_proj.weight.detach().double()
    gram = sum(wo[:, j * D : (j + 1) * D].T @ wo[:, j * D : (j + 1) * D] for j in (3, 4, 5))
    assert torch.allclose(m[7, 1, D : 2 * D, D : 2 * D], gram, rtol=1e-12, atol=0)
    assert torch.equal(PH.metric_from(model, ids), m)  # the same contexts give the same metric


def test_llama3_scaling_is_the_models_and_gqa_groups_query_heads():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = _tiny(rope_parameters=LLAMA3)
    want = ROPE_INIT_FUNCTIONS["llama3"](model.config)[0].double().numpy()
    got = PH.rotary_inv_freq(model)
    assert np.array_equal(got, want) and not np.array_equal(got, PH.rotary_inv_freq(_tiny()))
    m = PH.metric_from(model, [torch.arange(10), torch.arange(5, 40)])
    assert m.shape == (2, 2, 16, 16)
    wo = model.model.layers[1].self_attn.o_proj.weight.detach().double()  # query heads 2, 3 -> KV head 1
    gram = sum(wo[:, j * 8 : (j + 1) * 8].T @ wo[:, j * 8 : (j + 1) * 8] for j in (2, 3))
    assert torch.allclose(m[1, 1, 8:, 8:], gram, rtol=1e-12, atol=0)


@pytest.mark.parametrize("rope", [None, LLAMA3], ids=["smollm2-default", "tiny-llama3"])
def test_inv_freq_equals_vllms(rope):
    require_vllm()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    if rope is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    else:
        model = _tiny(rope_parameters=rope)
    cfg = model.config
    with set_current_vllm_config(VllmConfig()):
        r = get_rope(cfg.head_dim, cfg.max_position_embeddings, True, cfg.rope_parameters, torch.float32)
        theirs = r._compute_inv_freq(r.base).double().numpy()
    assert np.array_equal(PH.rotary_inv_freq(model), theirs)


def _drop(model, layer: int, proj: str):
    setattr(model.model.layers[layer].self_attn, proj, torch.nn.Identity())
    return model


def _odd_heads(model):
    for layer in model.model.layers:  # 4 query heads of 5
        layer.self_attn.q_proj = torch.nn.Linear(32, 20, bias=False)
        layer.self_attn.o_proj = torch.nn.Linear(20, 32, bias=False)
    return model


UNSUPPORTED = {  # name: (model maker, message, refused by the metric too (a layout error))
    "no-q_proj": (
        lambda: _drop(_tiny(), 1, "q_proj"),
        r"model\.layers\.1\.self_attn \(LlamaAttention\) has no q_proj",
        True,
    ),
    "no-o_proj": (
        lambda: _drop(_tiny(), 0, "o_proj"),
        r"model\.layers\.0\.self_attn \(LlamaAttention\) has no o_proj",
        True,
    ),
    "odd-head-size": (lambda: _odd_heads(_tiny()), "head size 5 is odd", True),
    "yarn": (
        lambda: _tiny(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=8.0)),
        r"rope type 'yarn' scales cos/sin by 1\.2\d+ \(attention_scaling != 1\): unsupported",
        False,
    ),
    "dynamic": (
        lambda: _tiny(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
        "rope type 'dynamic': frequencies change with the sequence length: unsupported",
        False,
    ),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_models_are_refused_by_name(name):
    make, match, layout = UNSUPPORTED[name]
    model = make()
    with pytest.raises(PH.CalibrationError, match=match):
        PH.rotary_inv_freq(model)
    if layout:
        with pytest.raises(PH.CalibrationError, match=match):
            PH.metric_from(model, [torch.arange(4)])


def test_bad_inputs_are_refused(tmp_path):
    from transformers import ViTConfig

    assert issubclass(PH.CalibrationError, ValueError) and issubclass(PH.CalibrationError, LMTierError)
    with pytest.raises(PH.CalibrationError, match="does not exist"):
        PH.collect(tmp_path / "missing", [LONG])
    with pytest.raises(PH.CalibrationError, match="holds no config.json"):
        PH.collect(tmp_path, [LONG])
    ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(PH.CalibrationError, match="model type 'vit' is not a causal LM"):
        PH.collect(tmp_path, [LONG])
    model = _tiny()
    with pytest.raises(PH.CalibrationError, match="no calibration texts"):
        PH.metric_from(model, [])
    with pytest.raises(PH.CalibrationError, match=r"text 1 has 1 token\(s\); at least 2 are needed"):
        PH.metric_from(model, [torch.arange(4), torch.arange(1)])
    with pytest.raises(PH.CalibrationError, match="token ids must be 1-D int64"):
        PH.metric_from(model, [torch.arange(4)[None]])


@needs_model
def test_bad_texts_and_max_tokens_are_refused(smol):
    model, tok = smol
    with pytest.raises(PH.CalibrationError, match="max_tokens must be >= 2, got 1"):
        PH.collect_from_model(model, tok, [LONG], model_name="s", max_tokens=1)
    with pytest.raises(PH.CalibrationError, match="no calibration texts"):
        PH.collect_from_model(model, tok, [], model_name="s")
    assert len(tok("a").input_ids) == 1
    with pytest.raises(PH.CalibrationError, match=r"text 1 has 1 token\(s\)"):
        PH.collect_from_model(model, tok, [LONG, "a"], model_name="s", max_tokens=MAX_TOKENS)


def test_tiny_checkpoint_is_collected(tiny_dir):
    cal = PH.collect(tiny_dir, [WORDS, "w1 w2 w3"], max_tokens=32)
    assert cal.model_name == tiny_dir.name
    assert [tuple(kv.shape) for kv in cal.kv] == [(2, 2, 32, 2, 8), (2, 2, 3, 2, 8)]
    assert cal.metric.shape == (2, 2, 16, 16) and cal.inv_freq.shape == (4,)


BAD_TEXTS = {  # name: (texts, message)
    "str": ("w1 w2 w3", r"texts must be a sequence of str, got a str \(a single text: pass \[text\]\)"),
    "bytes": (b"w1 w2 w3", "texts must be a sequence of str, got a bytes"),
    "bytes-text": (["w1 w2", b"w1 w2"], "text 1 is a bytes, not a str"),
    "none-text": ([None], "text 0 is a NoneType, not a str"),
    "int": (7, "texts must be a sequence of str, got a int"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_TEXTS))
def test_texts_that_are_not_a_sequence_of_str_are_refused(name, tiny_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    texts, match = BAD_TEXTS[name]
    with pytest.raises(PH.CalibrationError, match=match):
        PH.collect_from_model(_tiny(), _word_tokenizer(), texts, model_name="t")

    def no_load(*a, **kw):
        raise AssertionError("collect loaded the model before checking the texts")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(PH.CalibrationError, match=match):
        PH.collect(tiny_dir, texts)


def _edit_config(d, **kw):
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **kw}))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BROKEN = {  # name: (damage to a copy of the tiny checkpoint, message after "{dir}: cannot load the ")
    "bad-json": (
        lambda d: (d / "config.json").write_text("{bad"),
        r"config: OSError: It looks like the config file at '\S+config\.json' is not a valid JSON file\.",
    ),
    "unknown-model-type": (
        lambda d: _edit_config(d, model_type="nosuch"),
        "config: ValueError: The checkpoint you are trying to load has model type `nosuch` but Transformers "
        "does not recognize this architecture.",
    ),
    "bad-field": (
        lambda d: _edit_config(d, num_hidden_layers="two"),
        "config: StrictDataclassFieldValidationError: Validation error for field 'num_hidden_layers': TypeError",
    ),
    "no-tokenizer": (
        lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
        r"tokenizer: ValueError: Couldn't instantiate the backend tokenizer from one of: \(1\) a `tokenizers`",
    ),
    "no-weights": (
        lambda d: (d / "model.safetensors").unlink(),
        "model: OSError: Error no file named model.safetensors, or pytorch_model.bin, found in directory",
    ),
    "truncated-weights": (
        lambda d: _truncate(d / "model.safetensors"),
        "model: SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered",
    ),
    "shape-mismatch": (
        lambda d: _edit_config(d, intermediate_size=48),
        "model: RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error.",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BROKEN))
def test_checkpoints_transformers_cannot_load_are_refused_naming_the_directory(name, tiny_dir, tmp_path):
    damage, message = BROKEN[name]
    d = shutil.copytree(tiny_dir, tmp_path / "ckpt")
    damage(d)
    with pytest.raises(PH.CalibrationError) as e:
        PH.collect(d, [WORDS])
    why = str(e.value)
    assert why.startswith(f"{d}: cannot load the ") and "\n" not in why  # one line: the command prints it so
    assert re.match(message, why.removeprefix(f"{d}: cannot load the ")), why
    assert e.value.__cause__ is not None and type(e.value.__cause__).__name__ in why


GEOMETRY = {  # name: (config.json text, (L, H, D) or None)
    "head_dim": ('{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}',
                 (30, 3, 64)),
    "hidden/heads": ('{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, '
                     '"hidden_size": 4096, "head_dim": null}', (32, 8, 128)),
    "no-kv-heads": ('{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32}', (2, 4, 8)),
    "no-layers": ('{"num_attention_heads": 4, "hidden_size": 32}', None),
    "bool-layers": ('{"num_hidden_layers": true, "num_attention_heads": 4, "hidden_size": 32}', None),
    "uneven": ('{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 32}', None),
    "not-an-object": ("[1, 2]", None),
    "bad-json": ("{bad", None),
    "not-utf8": (b"\xff", None),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GEOMETRY))
def test_checkpoint_geometry_reads_config_json(name, tmp_path):
    text, want = GEOMETRY[name]
    f = tmp_path / "config.json"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert PH.checkpoint_geometry(tmp_path) == want
    assert PH.checkpoint_geometry(tmp_path / "missing") is None


def test_checkpoint_geometry_agrees_with_the_collected_kv(tiny_dir):
    nl, _, _, h, d = PH.collect(tiny_dir, [WORDS], max_tokens=8).kv[0].shape
    assert PH.checkpoint_geometry(tiny_dir) == (nl, h, d) == (2, 2, 8)
