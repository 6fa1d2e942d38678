"""KV-cache decoding for evaluation and demos: greedy, temperature, top-k, top-p, stop tokens and strings.

The cache lives outside the model. ``KVCache`` preallocates, per layer, keys and
values [B, max_len, Hkv, D] plus a key mask [B, max_len] (False for padded
prompt slots and slots not written yet). A forward with ``kv_cache=`` writes the
T new keys/values at ``cache.length`` and attends over slots [0, length + T)
with bottom-right causal alignment, so query i of the step sees every earlier
slot and itself; then ``length += T``.

Sliding-window layers (window W < max_len) keep a ring of W slots instead: slot s
lives at ring index s mod W. A query at slot s sees slots s - W + 1 .. s only, so a
single decoded token attends over the ring once its own key is written (the ring
is its window; attention does not depend on the keys' order), and a chunk of T
tokens over the ring's last min(s, W - 1) slots in time order followed by the
chunk itself, with the window mask. RoPE is applied before caching, so a ring slot
keeps its absolute position. The ring's memory is W / max_len of a full buffer.

Positions: each row counts its real tokens (``next_position`` [B]), so a
left-padded prompt gets positions 0, 1, ... on its first real token, exactly
as the same prompt unpadded.

Sampling of the next token from logits z (float32) at the last position:

    greedy            argmax z                              (temperature == 0)
    temperature T     p = softmax(z / T)
    top-k             keep the k largest z, others -inf
    top-p (nucleus)   keep the smallest set of most likely tokens whose
                      probability mass reaches p (Holtzman et al. 2019); p = 1
                      keeps every token (no filtering, whatever the rounding)
    min-p             keep the tokens with p >= min_p * max p (Nguyen et al. 2024),
                      p after temperature and the filters above

Stop strings (``stop_strings=`` with ``tokenizer=``, as transformers names them): after each
step every still-running row's text is extended by its new token's text only, found as
streaming detokenizers do (vLLM, transformers' TextStreamer): with p <= r offsets into the
row's tokens, new text = decode(toks[p:]) minus decode(toks[p:r]) (the previous token gives
the context a tokenizer needs for spaces), held back while it ends in an incomplete UTF-8
character (U+FFFD). The row stops at the first token after which the last L - 1 characters of
the earlier text (L the longest stop string) plus the new text hold a stop string, so a string
spanning token boundaries is found and each step decodes a couple of tokens, not the
completion. The stop token is kept and the rest of the row padded, as for a stop token.

Generation runs under ``torch.no_grad()``; the model's training mode is left as
the caller set it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["KVCache", "StopStrings", "generate", "sample_next"]


class KVCache:
    """Per-layer key/value buffers and a key mask [B, max_len] (see the module docstring).

    ``windows`` (one entry per layer, None = full attention; ``for_model`` reads the config's
    ``layer_window``): a layer with window W < max_len keeps a ring of W slots [B, W, Hkv, D],
    every other layer max_len slots [B, max_len, Hkv, D].
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 *, windows: Sequence[int | None] | None = None, dtype: torch.dtype = torch.float32, device=None):
        windows = [None] * num_layers if windows is None else list(windows)
        if len(windows) != num_layers:
            raise ValueError(f"KVCache: windows has {len(windows)} entries for {num_layers} layers")
        for i, w in enumerate(windows):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"KVCache: windows[{i}] must be a positive int or None, got {w!r}")
        # a window as long as the cache never wraps: that layer is a plain buffer
        self.ring = [w if w is not None and w < max_len else None for w in windows]  # ring size per layer
        sizes = [max_len if r is None else r for r in self.ring]
        self.k = [torch.zeros(batch_size, n, num_kv_heads, head_dim, dtype=dtype, device=device) for n in sizes]
        self.v = [torch.zeros(batch_size, n, num_kv_heads, head_dim, dtype=dtype, device=device) for n in sizes]
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # per slot, all layers
        self.next_position = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0  # slots written by completed forwards
        self._pending: torch.Tensor | None = None  # real tokens per row in the forward under way
        self._ring_masks: dict[int, torch.Tensor] = {}  # ring size -> key mask of its slots, this forward

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int, *, dtype=None, device=None) -> KVCache:
        """A cache shaped for ``model`` (a LlamaForCausalLM), in its parameters' dtype and device;
        its sliding-window layers get rings of their window."""
        cfg = model.config
        p = next(model.parameters())
        windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
        return cls(cfg.num_hidden_layers, batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim,
                   windows=windows, dtype=dtype or p.dtype, device=device or p.device)

    def nbytes(self, layer: int | None = None) -> int:
        """Bytes of the key and value buffers of ``layer`` (default: all layers)."""
        layers = range(len(self.k)) if layer is None else [layer]
        return sum(t.numel() * t.element_size() for i in layers for t in (self.k[i], self.v[i]))

    def reset(self) -> None:
        """Forget everything written (buffers are kept for reuse)."""
        self.key_mask.zero_()
        self.next_position.zero_()
        self.length = 0

    # -- called by the model's forward -------------------------------------------------
    def prepare(self, attention_mask: torch.Tensor | None, t: int) -> torch.Tensor:
        """Mark slots [length, length+t) valid per ``attention_mask`` [B, t]; return position_ids [B, t]."""
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"KVCache is full: {self.length} slots used + {t} new > max_len={self.max_len}")
        if attention_mask is None:
            mask = torch.ones(self.batch_size, t, dtype=torch.bool, device=self.key_mask.device)
        else:
            if attention_mask.shape != (self.batch_size, t):
                raise ValueError(
                    f"with a KVCache attention_mask covers the new tokens only: expected {(self.batch_size, t)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.bool()
        self.key_mask[:, self.length:end] = mask
        self._ring_masks = {}
        counts = mask.long().cumsum(-1)  # (B, t)
        positions = (self.next_position[:, None] + counts - 1).clamp(min=0)
        self._pending = counts[:, -1]
        return positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None):
        """Write k/v [B, t, Hkv, D] of the slots [length, length+t); return keys, values [B, L, Hkv, D] and
        their mask [B, L] such that causal bottom-right attention with the layer's window over them is
        the attention over every slot so far. ``window``: the layer's sliding window (None: full), which
        a ring must equal.

        Full layers: the slots [0, length+t). Ring layers (ring size W, slot s at index s mod W): for a
        single token, the ring after the write (the slots length+1-W .. length: exactly its window, in
        ring order); for a chunk, the last min(length, W - 1) slots in time order followed by the chunk
        (window + chunk), then the chunk's last min(t, W) slots are written.
        """
        start, t = self.length, k.shape[1]
        end = start + t
        w = self.ring[layer]
        if w is not None and w != window:  # a smaller ring would drop keys the layer sees, a ring on a full layer too
            raise ValueError(f"KVCache: layer {layer} keeps a ring of {w} slots but attends with window {window}; "
                             "build the cache with KVCache.for_model(model, ...)")
        if w is None:
            self.k[layer][:, start:end] = k
            self.v[layer][:, start:end] = v
            return self.k[layer][:, :end], self.v[layer][:, :end], self.key_mask[:, :end]
        if t == 1:  # decoding: the ring is the window; order does not matter to attention
            self.k[layer][:, start % w] = k[:, 0]
            self.v[layer][:, start % w] = v[:, 0]
            return self.k[layer], self.v[layer], self._ring_mask(w, end)
        n = min(start, w - 1)  # earlier slots the chunk's first query sees (the oldest ring slot it does not)
        if n:
            idx = torch.arange(start - n, start, device=k.device) % w  # ring indices, oldest first
            keys, values = torch.cat([self.k[layer][:, idx], k], 1), torch.cat([self.v[layer][:, idx], v], 1)
        else:
            keys, values = k, v
        keep = min(t, w)
        idx = torch.arange(end - keep, end, device=k.device) % w
        self.k[layer][:, idx] = k[:, t - keep:]
        self.v[layer][:, idx] = v[:, t - keep:]
        return keys, values, self.key_mask[:, start - n:end]

    def _ring_mask(self, w: int, end: int) -> torch.Tensor:
        """Key mask [B, w] of a ring of ``w`` slots once slots [0, end) are written: index i holds
        slot end - 1 - ((end - 1 - i) mod w), none when that is negative."""
        if w not in self._ring_masks:
            i = torch.arange(w, device=self.key_mask.device)
            slot = end - 1 - (end - 1 - i) % w
            self._ring_masks[w] = self.key_mask[:, slot.clamp(min=0)] & (slot >= 0)
        return self._ring_masks[w]

    def advance(self, t: int) -> None:
        """Commit the t tokens of the forward that just ran."""
        self.length += t
        self.next_position += self._pending


class StopStrings:
    """Where a token stream's decoded text first holds one of ``strings`` (see the module docstring).

    ``scanner()`` follows one stream token by token (``push(token) -> bool``); ``first_stop(tokens)``
    is the index of the token at which a whole sequence first holds a stop string, or None.
    """

    def __init__(self, tokenizer, strings: Sequence[str] | str):
        strings = (strings,) if isinstance(strings, str) else tuple(strings)
        if not strings:
            raise ValueError("stop_strings is empty")
        for i, text in enumerate(strings):
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop_strings[{i}] must be a non-empty string, got {text!r}")
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"stop strings need a tokenizer with decode(ids) -> str, got {type(tokenizer).__name__}")
        self.tokenizer, self.strings = tokenizer, strings
        self.keep = max(map(len, strings)) - 1  # characters of earlier text a match can start in

    def scanner(self) -> _StopScan:
        return _StopScan(self)

    def first_stop(self, tokens: Iterable[int]) -> int | None:
        scan = self.scanner()
        for i, token in enumerate(tokens):
            if scan.push(int(token)):
                return i
        return None


class _StopScan:
    """One stream's incremental detokenization state for ``StopStrings``."""

    def __init__(self, stop: StopStrings):
        self.stop, self.tokens, self.prefix, self.read, self.tail = stop, [], 0, 0, ""

    def push(self, token: int) -> bool:
        """Append ``token``; True when the text so far holds a stop string (first seen at this token)."""
        self.tokens.append(token)
        decode = self.stop.tokenizer.decode
        text = decode(self.tokens[self.prefix:])
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the bytes still to come
            return False
        new = text[len(decode(self.tokens[self.prefix:self.read])):]
        self.prefix, self.read = self.read, len(self.tokens)
        window = self.tail + new
        self.tail = window[len(window) - self.stop.keep:] if self.stop.keep else ""
        return any(s in window for s in self.stop.strings)


def sample_next(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V] (see the module docstring for the rules)."""
    logits = logits.to(torch.float32)
    if temperature == 0.0:
        return logits.argmax(-1)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits / temperature
    if top_k is not None:
        if top_k <= 0:
            raise ValueError(f"top_k must be positive, got {top_k}")
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_p is not None and top_p < 1.0:  # top_p = 1 keeps every token: no filtering at all
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.double().softmax(-1)  # float64 mass: fp32 rounding must not move the cut
        # drop a token when the mass of the tokens ranked before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if min_p is not None:
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    stop_tokens: Iterable[int] | int | None = None,
    stop_strings: Sequence[str] | str | None = None,
    tokenizer=None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    kv_cache: KVCache | None = None,
) -> torch.Tensor:
    """Decode up to ``max_new_tokens`` after ``input_ids`` [B, T] (left-padded when ``attention_mask`` has 0s).

    Returns the new tokens [B, N], N <= max_new_tokens: a row that emits a stop
    token, or the token that completes one of ``stop_strings`` in its decoded text
    (``tokenizer.decode``), keeps it and is filled with ``pad_token_id`` after it;
    decoding ends early once every row has stopped. ``kv_cache`` (optional) must be empty and
    hold at least T + max_new_tokens slots; by default one is allocated here.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    if attention_mask is not None:
        if attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask must be [B, T]={(b, t)}, got {tuple(attention_mask.shape)}")
        m = attention_mask.bool()
        if (m[:, :-1] & ~m[:, 1:]).any():  # a real token followed by a pad: right padding
            raise ValueError("generate needs left-padded prompts (pads before the tokens in attention_mask)")
    if isinstance(stop_tokens, int):
        stop_tokens = [stop_tokens]
    stops = torch.tensor(list(stop_tokens or []), dtype=torch.long, device=input_ids.device)
    scans = None
    if stop_strings:
        if tokenizer is None:
            raise ValueError("generate: stop_strings needs tokenizer= (to decode each row's newest tokens)")
        check = StopStrings(tokenizer, stop_strings)
        scans = [check.scanner() for _ in range(b)]
    if kv_cache is None:
        kv_cache = KVCache.for_model(model, b, t + max_new_tokens)
    elif kv_cache.length != 0 or kv_cache.max_len < t + max_new_tokens or kv_cache.batch_size != b:
        raise ValueError(
            f"kv_cache must be empty with batch {b} and >= {t + max_new_tokens} slots; got length "
            f"{kv_cache.length}, batch {kv_cache.batch_size}, max_len {kv_cache.max_len}"
        )

    out = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long, device=input_ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    step_ids, step_mask = input_ids, attention_mask
    seen_mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    switch = _longrope_switch(model)
    n = 0
    for n in range(1, max_new_tokens + 1):
        if switch is not None and n > 1 and t + n - 1 > switch >= kv_cache.length:
            # longrope: the first step past the original context switches every position to the long
            # factors, so the cached keys (rotated with the short ones) are recomputed, as transformers does
            kv_cache.reset()
            step_ids, step_mask = torch.cat([input_ids, out[:, :n - 1]], dim=1), seen_mask
        hidden = model.model(step_ids, attention_mask=step_mask, kv_cache=kv_cache)  # (B, T_step, H)
        last = hidden[:, -1]  # (B, H): only the last position's logits are needed (soft-capped where configured)
        logits = model.logits(last) if hasattr(model, "logits") else model.lm_head(last)
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          generator=generator)
        out[:, n - 1] = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        if scans is not None:  # rows still running: does the new token's text complete a stop string?
            hit = [not d and scans[r].push(tok) for r, (d, tok) in enumerate(zip(done.tolist(), nxt.tolist()))]
            done |= torch.tensor(hit, dtype=torch.bool, device=done.device)
        done |= torch.isin(nxt, stops)
        if bool(done.all()):
            break
        # finished rows keep decoding in lockstep, with their new slots masked out of the cache
        step_ids, step_mask = nxt[:, None], ~done[:, None]
        seen_mask = torch.cat([seen_mask, step_mask], dim=1)
    return out[:, :n]


def _longrope_switch(model) -> int | None:
    """``original_max_position_embeddings`` of a longrope model (where its factors switch), else None."""
    scaling = getattr(getattr(model, "config", None), "rope_scaling", None) or {}
    return scaling.get("original_max_position_embeddings") if scaling.get("rope_type") == "longrope" else None
