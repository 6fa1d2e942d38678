"""KV-cache decoding equals full recomputation; sampling rules; stop tokens; cache checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlib.models import KVCache, generate, sample_next


def _greedy_recompute(model, ids, mask, n):
    # No cache: re-run the whole (left-padded) sequence for every new token.
    out = []
    for _ in range(n):
        nxt = model(ids, attention_mask=mask)[:, -1].argmax(-1)
        out.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(out, 1)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_kv_cache_greedy_equals_recompute_left_padded(make_model, model_type):
    model = make_model(model_type).double()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (3, 6), generator=g)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    mask[2, :5] = 0
    ids = ids * mask
    got = generate(model, ids, attention_mask=mask, max_new_tokens=8)
    want = _greedy_recompute(model, ids, mask, 8)
    assert torch.equal(got, want)
    # each padded row decodes exactly as its prompt alone
    for row in range(3):
        alone = generate(model, ids[row:row + 1, mask[row].bool()], max_new_tokens=8)
        assert torch.equal(alone[0], got[row])


def test_cache_logits_match_full_forward(make_model):
    model = make_model("mistral").double()
    ids = torch.randint(0, 128, (2, 9))
    full = model(ids)
    cache = KVCache.for_model(model, 2, 9)
    parts = [model(ids[:, :4], kv_cache=cache), model(ids[:, 4:5], kv_cache=cache), model(ids[:, 5:], kv_cache=cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.length == 9 and cache.next_position.tolist() == [9, 9]
    with pytest.raises(ValueError, match="KVCache is full"):
        model(ids[:, :1], kv_cache=cache)
    cache.reset()
    torch.testing.assert_close(model(ids, kv_cache=cache), full, rtol=1e-10, atol=1e-10)


def test_stop_tokens_and_padding(make_model):
    model = make_model()
    ids = torch.randint(0, 128, (2, 4))
    free = generate(model, ids, max_new_tokens=6)
    stop = int(free[0, 2])
    got = generate(model, ids, max_new_tokens=6, stop_tokens=[stop], pad_token_id=-1)
    first = (free[0] == stop).nonzero()[0].item()
    assert torch.equal(got[0, :first + 1], free[0, :first + 1]) and (got[0, first + 1:] == -1).all()
    if stop not in free[1].tolist():
        assert torch.equal(got[1], free[1])
    # every row stopped -> decoding ends early
    one = generate(model, ids[:1], max_new_tokens=6, stop_tokens=stop)
    assert one.shape[1] == first + 1


def test_sampling_is_seeded_and_kernels_of_rules(make_model):
    model = make_model()
    ids = torch.randint(0, 128, (2, 3))
    kw = dict(max_new_tokens=5, temperature=0.8, top_k=20, top_p=0.9)
    a = generate(model, ids, generator=torch.Generator().manual_seed(0), **kw)
    b = generate(model, ids, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a, b)
    greedy = generate(model, ids, max_new_tokens=5)
    assert torch.equal(generate(model, ids, max_new_tokens=5, temperature=1.0, top_k=1), greedy)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(1, 10), top_p=st.floats(0.05, 1.0))
def test_sample_next_stays_inside_top_k_and_nucleus(seed, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 16, generator=g) * 3
    tok = sample_next(logits, temperature=1.0, top_k=top_k, generator=g)
    rank = (logits > logits.gather(1, tok[:, None])).sum(1)
    assert (rank < top_k).all()
    tok = sample_next(logits, temperature=1.0, top_p=top_p, generator=g)
    probs = logits.softmax(-1)
    # mass of tokens strictly more likely than the sampled one is below top_p (it is in the nucleus)
    above = (probs * (probs > probs.gather(1, tok[:, None]))).sum(1)
    assert (above < top_p + 1e-6).all()


def test_top_p_one_is_a_no_op(monkeypatch):
    """Invariant: top_p=1.0 samples from the plain softmax, even where the fp32 running mass reaches 1
    before the last token (a dominant logit: p0 rounds to 1.0, the tail still has mass)."""
    seen = []
    real = torch.multinomial

    def spy(probs, n, generator=None):
        seen.append(probs.clone())
        return real(probs, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", spy)
    # p0 rounds to 1 in fp32 (row 0) and even in float64 (row 1); the tail keeps mass > 0 in fp32
    logits = torch.tensor([[20.0] + [0.0] * 7, [40.0] + [0.0] * 7, [3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    for temperature in (1.0, 0.7):
        sample_next(logits, temperature=temperature, top_p=1.0)
        sample_next(logits, temperature=temperature)
        with_p, without = seen[-2], seen[-1]
        assert torch.equal(with_p, without) and bool((with_p > 0).all())


def test_generate_rejects_bad_inputs(make_model):
    model = make_model()
    ids = torch.randint(0, 128, (2, 4))
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids, attention_mask=right)
    small = KVCache.for_model(model, 2, 5)
    with pytest.raises(ValueError, match="kv_cache must be empty"):
        generate(model, ids, max_new_tokens=4, kv_cache=small)
    with pytest.raises(ValueError, match="top_p"):
        sample_next(torch.zeros(1, 4), temperature=1.0, top_p=1.5)


@settings(max_examples=8, deadline=None)
@given(pads=st.lists(st.integers(0, 4), min_size=1, max_size=3), seed=st.integers(0, 99))
def test_kv_cache_property_left_padding(make_model, pads, seed):
    # invariant: with the cache, a left-padded batch decodes each row exactly like full recomputation
    model = make_model("llama").double()
    g = torch.Generator().manual_seed(seed)
    t = 5
    ids = torch.randint(1, 128, (len(pads), t), generator=g)
    mask = torch.ones_like(ids)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
    ids = ids * mask
    assert torch.equal(generate(model, ids, attention_mask=mask, max_new_tokens=4),
                       _greedy_recompute(model, ids, mask, 4))


def test_prefill_runs_as_varlen_and_decode_reads_the_cache(make_model, monkeypatch):
    """The prompt pass over an empty cache takes the varlen path (fused kernels, no T x T scores)."""
    import ftlib.models.llama as llama

    calls = []
    real = llama.attention
    monkeypatch.setattr(llama, "attention", lambda *a, **k: calls.append((a[0].dim(), k)) or real(*a, **k))
    model = make_model("qwen2").double()
    ids = torch.randint(1, 128, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    got = generate(model, ids * mask, attention_mask=mask, max_new_tokens=3)
    n_layers = model.config.num_hidden_layers
    prefill, decode = calls[:n_layers], calls[n_layers:]
    assert all(dim == 3 and k["cu_seqlens"].tolist() == [0, 6, 10, 12] for dim, k in prefill)
    assert decode and all(dim == 4 and k["key_padding_mask"] is not None for dim, k in decode)
    calls.clear()
    assert torch.equal(got, _greedy_recompute(model, ids * mask, mask, 3))


# -- sliding-window layers: a ring of `window` slots ----------------------------------------------

@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]], ids=["all", "alternating"])
def test_ring_cache_chunks_equal_full_forward(make_model, layer_types):
    """Chunks of every size (longer than the window, single tokens, a chunk straddling a wrap) over a
    left-padded batch give the logits of one full forward, and the window layers hold W slots only."""
    model = make_model("mistral", sliding_window=5, layer_types=layer_types).double()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 128, (3, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :9] = 0  # a row whose padding outlasts the first ring
    full = model(ids * mask, attention_mask=mask)
    cache = KVCache.for_model(model, 3, 30)
    parts = [model(ids[:, a:b] * mask[:, a:b], attention_mask=mask[:, a:b], kv_cache=cache)
             for a, b in [(0, 12), (12, 13), (13, 14), (14, 17), (17, 18), (18, 26), (26, 27), (27, 30)]]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(parts, 1)[real], full[real], rtol=1e-10, atol=1e-10)
    for i, layer in enumerate(model.model.layers):
        slots = 5 if layer.self_attn.sliding_window else 30
        assert cache.k[i].shape == cache.v[i].shape == (3, slots, 2, 8)


def test_ring_cache_greedy_equals_recompute_left_padded(make_model):
    model = make_model("mistral", sliding_window=4, layer_types=["sliding_attention", "full_attention"]).double()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :6] = 0
    ids = ids * mask
    assert torch.equal(generate(model, ids, attention_mask=mask, max_new_tokens=12),
                       _greedy_recompute(model, ids, mask, 12))


def test_ring_cache_bytes_and_arguments(make_model):
    model = make_model("mistral", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    cache = KVCache.for_model(model, 2, 100)
    per_slot = 2 * 2 * 8 * 4  # B * Hkv * D * fp32 bytes, for k and for v
    assert cache.nbytes(0) == 2 * 8 * per_slot and cache.nbytes(1) == 2 * 100 * per_slot
    assert cache.nbytes() == cache.nbytes(0) + cache.nbytes(1)
    short = KVCache.for_model(model, 2, 6)  # the window outlasts the cache: a plain buffer of 6
    assert short.k[0].shape[1] == short.k[1].shape[1] == 6
    with pytest.raises(ValueError, match=r"windows\[1\] must be a positive int"):
        KVCache(2, 1, 10, 2, 8, windows=[4, 0])
    with pytest.raises(ValueError, match="windows has 1 entries for 2 layers"):
        KVCache(2, 1, 10, 2, 8, windows=[4])
    wrong = KVCache(2, 2, 100, 2, 8, windows=[4, None])  # a ring smaller than the layer's window of 8
    with pytest.raises(ValueError, match="layer 0 keeps a ring of 4 slots but attends with window 8"):
        generate(model, torch.ones(2, 3, dtype=torch.long), max_new_tokens=2, kv_cache=wrong)


WINDOW_CASES = ["mistral-window", "qwen3-tied-window", "gemma2", "gemma3"]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_ring_cache_greedy_matches_transformers_past_the_window(case, tmp_path):
    """A 12-token prompt (prefill longer than the window of 8) and 40 greedy tokens (32 past the window)
    equal transformers' greedy decoding, with the window layers' keys and values in rings of 8 slots."""
    transformers = pytest.importorskip("transformers")
    from test_families import hf_model, ids

    from ftlib.models import load_pretrained

    hf_model(case).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_pretrained(tmp_path)
    prompt = ids(1, 12, seed=3)
    hf.generation_config.eos_token_id = None  # no stop token on either side
    want = hf.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[:, 12:]
    cache = KVCache.for_model(ours, 1, 52)
    got = generate(ours, prompt, max_new_tokens=40, kv_cache=cache)
    assert torch.equal(got, want), (got, want)
    seq = torch.cat([prompt, got], 1)  # every position's logits through the ring: 12, then one token at a time
    cache = KVCache.for_model(ours, 1, 52)
    with torch.no_grad():
        steps = [ours(seq[:, :12], kv_cache=cache)] + [ours(seq[:, j:j + 1], kv_cache=cache) for j in range(12, 52)]
        full = hf(seq).logits
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5
    windowed = [i for i, layer in enumerate(ours.model.layers) if layer.self_attn.sliding_window]
    assert windowed
    cfg = ours.config
    for i in range(cfg.num_hidden_layers):
        slots = 8 if i in windowed else 52
        assert cache.k[i].shape == (1, slots, cfg.num_key_value_heads, cfg.head_dim)
        assert cache.nbytes(i) == 2 * slots * cfg.num_key_value_heads * cfg.head_dim * 4


# -- stop strings halt decoding ---------------------------------------------------------------------

class _TwoChar:
    """Each token decodes to two letters, so a string can start in one token and end in the next."""

    def decode(self, ids):
        return "".join(chr(65 + i // 26 % 26) + chr(97 + i % 26) for i in ids)


def _first_prefix_holding(tok, ids, stop):
    """The reference rule, by brute force: the shortest prefix whose whole decoded text holds ``stop``."""
    return next((k for k in range(len(ids)) if stop in tok.decode(ids[:k + 1])), None)


def _count_forwards(model):
    calls = []
    model.model.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    return calls


def test_stop_string_spanning_tokens_halts_decoding(make_model):
    model = make_model()
    tok = _TwoChar()
    ids = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(6))
    free = generate(model, ids, max_new_tokens=20)
    row0, row1 = free[0].tolist(), free[1].tolist()
    # each stop string is the last letter of one token and the first of the next: it exists only once
    # the second token is out, and first occurs there (new token 5 of row 0, new token 7 of row 1)
    stop0, stop1 = tok.decode(row0)[9:11], tok.decode(row1)[13:16]
    assert _first_prefix_holding(tok, row0, stop0) == 5 and _first_prefix_holding(tok, row1, stop1) == 7
    assert stop0 not in tok.decode(row0[5:6]) and stop1 not in tok.decode(row1[7:8])
    assert _first_prefix_holding(tok, row1, stop0) is None and _first_prefix_holding(tok, row0, stop1) is None
    calls = _count_forwards(model)
    got = generate(model, ids, max_new_tokens=20, stop_strings=[stop0], tokenizer=tok, pad_token_id=-1)
    assert got.shape[1] == len(calls) == 20 and got[1].tolist() == row1  # row 1 never stops
    assert got[0, :6].tolist() == row0[:6] and (got[0, 6:] == -1).all()  # row 0 cut after the string's end
    calls.clear()  # both rows stop: decoding ends at the later stop, one forward per new token
    got = generate(model, ids, max_new_tokens=20, stop_strings=(stop0, stop1), tokenizer=tok, pad_token_id=-1)
    assert got.shape[1] == len(calls) == 8
    assert got[0].tolist() == row0[:6] + [-1, -1] and got[1].tolist() == row1[:8]
    with pytest.raises(ValueError, match="stop_strings needs tokenizer="):
        generate(model, ids, max_new_tokens=2, stop_strings=["x"])
    with pytest.raises(ValueError, match=r"stop_strings\[1\] must be a non-empty string"):
        generate(model, ids, max_new_tokens=2, stop_strings=["x", ""], tokenizer=tok)


def _bytes_tokenizer():
    """One token per byte (no merges): a multi-byte character always spans tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


_BYTES = _bytes_tokenizer()


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab é€ü", min_size=1, max_size=14), data=st.data())
def test_stop_strings_scan_equals_the_whole_text_rule(text, data):
    """Invariant: the incremental scan stops where the shortest prefix's whole decoded text first holds a
    stop string, with multi-byte characters split over byte tokens (the partial character waits)."""
    from ftlib.models.generate import StopStrings

    ids = _BYTES.encode(text).ids
    i = data.draw(st.integers(0, len(text) - 1))
    stop = data.draw(st.sampled_from([text[i:i + n] for n in (1, 2, 3)] + ["€", "b é"]))
    assert StopStrings(_BYTES, [stop]).first_stop(ids) == _first_prefix_holding(_BYTES, ids, stop)


def _metaspace_tokenizer():
    """SentencePiece-style pieces: a token's leading space shows only after another token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"▁a": 0, "▁b": 1, "a": 2, "b": 3, "▁é": 4, "é": 5, "<unk>": 6}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return tok


_PIECES = _metaspace_tokenizer()


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 5), min_size=1, max_size=12), data=st.data())
def test_stop_strings_scan_keeps_the_spaces_between_tokens(ids, data):
    """Same invariant where decoding tokens one by one would lose the spaces (``▁b`` alone is "b")."""
    from ftlib.models.generate import StopStrings

    text = _PIECES.decode(ids)
    i = data.draw(st.integers(0, len(text) - 1))
    stop = data.draw(st.sampled_from([text[i:i + n] for n in (1, 2, 3)] + ["a b", " é"]))
    assert StopStrings(_PIECES, [stop]).first_stop(ids) == _first_prefix_holding(_PIECES, ids, stop)
