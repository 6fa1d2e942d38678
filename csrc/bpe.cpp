// Byte-level BPE encoder: the token ids and character offsets Hugging Face `tokenizers` gives for
// GPT-2's ByteLevel pre-tokenizer and for the Llama-3 / Qwen2 Split patterns, without its per-token
// strings and Python objects. Built on first use by ftlib/_cbuild.py, called through ctypes by
// ftlib/data/fast_bpe.py, which decides when a tokenizer.json is one of these exactly (else it uses
// `tokenizers` itself) and checks the result against it in tests/data/test_fast_bpe.py.
//
// Per text: split out the added tokens (leftmost-longest match, as tokenizers' added vocabulary),
// pre-tokenize each piece between them with a hand-written matcher of the regex (alternation order
// and backtracking of the pattern spelled out below), then run BPE on each pre-token's bytes: merge
// the adjacent pair of lowest merge rank (leftmost on ties) until none is in the merge table. Results
// per distinct pre-token are cached (the encoding of a pre-token does not depend on its context).
// Offsets are in characters (code points) of the text, a token covering part of a character's bytes
// gets that whole character, as tokenizers reports them.
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

enum : uint8_t { CL_L = 1, CL_N = 2, CL_S = 4 };  // \p{L}, \p{N}, \s (Unicode White_Space)
enum { MODE_GPT2 = 0, MODE_LLAMA3 = 1 };         // GPT-2's pattern; the Llama-3 / Qwen2 family

inline uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// Open-addressing map from a pre-token's bytes to its token ids (keys and values in arenas).
struct WordCache {
  struct Slot { uint64_t hash; uint32_t koff, klen, voff, vlen; };
  std::vector<Slot> slots;
  std::vector<uint8_t> keys;
  std::vector<int32_t> vals;
  size_t used = 0;
  WordCache() { reset(1 << 16); }
  void reset(size_t cap) {
    slots.assign(cap, Slot{0, 0, 0, 0, UINT32_MAX});
    keys.clear(); vals.clear(); used = 0;
  }
  // Pointer to the slot of key (empty slot: vlen == UINT32_MAX).
  Slot* find(const uint8_t* k, uint32_t n, uint64_t h) {
    size_t mask = slots.size() - 1, i = h & mask;
    for (;; i = (i + 1) & mask) {
      Slot& s = slots[i];
      if (s.vlen == UINT32_MAX) return &s;
      if (s.hash == h && s.klen == n && std::memcmp(keys.data() + s.koff, k, n) == 0) return &s;
    }
  }
  void insert(const uint8_t* k, uint32_t n, uint64_t h, const int32_t* v, uint32_t m) {
    if (keys.size() + n > (1u << 30) || vals.size() + m > (1u << 30) || used >= (1u << 22)) reset(slots.size());
    if (2 * (used + 1) > slots.size()) grow();
    Slot* s = find(k, n, h);
    s->hash = h; s->koff = (uint32_t)keys.size(); s->klen = n; s->voff = (uint32_t)vals.size(); s->vlen = m;
    keys.insert(keys.end(), k, k + n);
    vals.insert(vals.end(), v, v + m);
    ++used;
  }
  void grow() {
    std::vector<Slot> old;
    old.swap(slots);
    slots.assign(old.size() * 2, Slot{0, 0, 0, 0, UINT32_MAX});
    size_t mask = slots.size() - 1;
    for (const Slot& s : old) {
      if (s.vlen == UINT32_MAX) continue;
      size_t i = s.hash & mask;
      while (slots[i].vlen != UINT32_MAX) i = (i + 1) & mask;
      slots[i] = s;
    }
  }
};

struct Encoder {
  int mode = MODE_GPT2, max_digits = 0;
  bool ignore_merges = false;
  std::vector<uint8_t> cls;                    // class bits per code point (0x110000)
  int32_t byte_id[256];
  std::vector<int32_t> token_len;              // bytes of each model token
  std::unordered_map<uint64_t, uint64_t> merges;  // (left << 32 | right) -> (rank << 32 | result)
  std::unordered_map<std::string, int32_t> vocab;  // bytes -> id (ignore_merges)
  std::vector<std::string> special;            // added tokens, longest first
  std::vector<int32_t> special_id;
  std::vector<int> special_norm;           // 0: matched on the raw text, 1: normalized
  bool special_first[2][256] = {{false}};
  WordCache cache;
  // scratch
  std::vector<uint32_t> cps;
  std::vector<int64_t> boff;
  std::vector<int32_t> sym, word;
  std::vector<uint64_t> rank;

  inline uint8_t cl(uint32_t c) const { return c < cls.size() ? cls[c] : 0; }
  inline bool isL(uint32_t c) const { return cl(c) & CL_L; }
  inline bool isN(uint32_t c) const { return cl(c) & CL_N; }
  inline bool isS(uint32_t c) const { return cl(c) & CL_S; }
  inline bool isO(uint32_t c) const { return !(cl(c) & (CL_L | CL_N | CL_S)); }

  static inline uint32_t lower_ascii(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

  // Length (in chars) of the contraction at i, or 0.
  size_t contraction(size_t i, size_t n) const {
    if (cps[i] != '\'' || i + 1 >= n) return 0;
    auto f = [&](uint32_t c) { return mode == MODE_GPT2 ? c : lower_ascii(c); };
    uint32_t a = f(cps[i + 1]);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (i + 2 >= n) return 0;
    uint32_t b = f(cps[i + 2]);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
  }

  // End (char index) of the pre-token starting at char i of a piece of n chars.
  size_t next_pretoken(size_t i, size_t n) const {
    if (size_t c = contraction(i, n)) return i + c;
    uint32_t c = cps[i];
    size_t j;
    if (mode == MODE_GPT2) {  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
      size_t k = (c == ' ' && i + 1 < n) ? i + 1 : i;
      if (isL(cps[k])) { for (j = k; j < n && isL(cps[j]); ++j) {} return j; }
      if (isN(cps[k])) { for (j = k; j < n && isN(cps[j]); ++j) {} return j; }
      if (isO(cps[k])) { for (j = k; j < n && isO(cps[j]); ++j) {} return j; }
    } else {  // (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
      if (!isL(c) && !isN(c) && c != '\r' && c != '\n' && i + 1 < n && isL(cps[i + 1])) {
        for (j = i + 1; j < n && isL(cps[j]); ++j) {}
        return j;
      }
      if (isL(c)) { for (j = i; j < n && isL(cps[j]); ++j) {} return j; }
      if (isN(c)) { for (j = i; j < n && j - i < (size_t)max_digits && isN(cps[j]); ++j) {} return j; }
      size_t k = (c == ' ' && i + 1 < n) ? i + 1 : i;
      if (isO(cps[k])) {
        for (j = k; j < n && isO(cps[j]); ++j) {}
        while (j < n && (cps[j] == '\r' || cps[j] == '\n')) ++j;
        return j;
      }
      // c is whitespace here: \s*[\r\n]+ takes the run up to its last line break
      for (j = i; j < n && isS(cps[j]); ++j) {}
      for (size_t p = j; p > i; --p)
        if (cps[p - 1] == '\r' || cps[p - 1] == '\n') return p;
    }
    // whitespace: \s+(?!\S) leaves the run's last char to the next token unless the piece ends; else \s+
    for (j = i; j < n && isS(cps[j]); ++j) {}
    if (j == i) return i + 1;  // not reached for valid classes; never loop forever
    if (j == n) return n;
    return j - i >= 2 ? j - 1 : i + 1;
  }

  // BPE of one pre-token's bytes; appends ids to out.
  void bpe(const uint8_t* p, size_t n, std::vector<int32_t>& out) {
    uint64_t h = fnv1a(p, n);
    WordCache::Slot* s = cache.find(p, (uint32_t)n, h);
    if (s->vlen != UINT32_MAX) {
      const int32_t* v = cache.vals.data() + s->voff;
      out.insert(out.end(), v, v + s->vlen);
      return;
    }
    word.clear();
    if (ignore_merges) {
      auto it = vocab.find(std::string((const char*)p, n));
      if (it != vocab.end()) word.push_back(it->second);
    }
    if (word.empty()) {
      sym.assign(n, 0);
      for (size_t i = 0; i < n; ++i) sym[i] = byte_id[p[i]];
      size_t m = n;
      rank.assign(m ? m - 1 : 0, UINT64_MAX);
      auto pair_rank = [&](size_t i) -> uint64_t {
        auto it = merges.find((uint64_t)(uint32_t)sym[i] << 32 | (uint32_t)sym[i + 1]);
        return it == merges.end() ? UINT64_MAX : it->second;
      };
      for (size_t i = 0; i + 1 < m; ++i) rank[i] = pair_rank(i);
      while (m > 1) {
        size_t best = 0;
        for (size_t i = 1; i + 1 < m; ++i)
          if ((rank[i] >> 32) < (rank[best] >> 32)) best = i;
        if (rank[best] == UINT64_MAX) break;
        sym[best] = (int32_t)(rank[best] & 0xffffffffu);
        sym.erase(sym.begin() + best + 1);
        rank.erase(rank.begin() + best);  // the pair (best, best + 1) is gone
        --m;
        if (best + 1 < m) rank[best] = pair_rank(best);
        if (best > 0) rank[best - 1] = pair_rank(best - 1);
      }
      word.assign(sym.begin(), sym.begin() + m);
    }
    cache.insert(p, (uint32_t)n, h, word.data(), (uint32_t)word.size());
    out.insert(out.end(), word.begin(), word.end());
  }

  // Decode bytes [a, b) of text into cps / boff (boff[k] = byte offset of char k, boff[n] = b).
  void decode(const uint8_t* t, int64_t a, int64_t b) {
    cps.clear(); boff.clear();
    for (int64_t i = a; i < b;) {
      uint8_t c = t[i];
      uint32_t cp; int len;
      if (c < 0x80) { cp = c; len = 1; }
      else if ((c >> 5) == 6) { cp = c & 0x1f; len = 2; }
      else if ((c >> 4) == 14) { cp = c & 0x0f; len = 3; }
      else { cp = c & 0x07; len = 4; }
      for (int k = 1; k < len && i + k < b; ++k) cp = (cp << 6) | (t[i + k] & 0x3f);
      cps.push_back(cp);
      boff.push_back(i);
      i += len;
    }
    boff.push_back(b);
  }
};

}  // namespace

extern "C" {

void* ftlib_bpe_new(int32_t mode, int32_t max_digits, int32_t ignore_merges, const uint8_t* cls, int64_t n_cls,
                    int64_t n_vocab, const int32_t* vocab_ids, const uint8_t* vocab_bytes, const int64_t* vocab_off,
                    int64_t n_merges, const int32_t* merges, const int32_t* byte_ids,
                    int64_t n_special, const int32_t* special_ids, const uint8_t* special_bytes,
                    const int64_t* special_off, const int32_t* special_norm) {
  Encoder* e = new Encoder();
  e->mode = mode;
  e->max_digits = max_digits;
  e->ignore_merges = ignore_merges != 0;
  e->cls.assign(cls, cls + n_cls);
  std::memcpy(e->byte_id, byte_ids, sizeof(e->byte_id));
  int32_t max_id = 0;
  for (int64_t i = 0; i < n_vocab; ++i) max_id = vocab_ids[i] > max_id ? vocab_ids[i] : max_id;
  e->token_len.assign((size_t)max_id + 1, 0);
  for (int64_t i = 0; i < n_vocab; ++i) {
    e->token_len[vocab_ids[i]] = (int32_t)(vocab_off[i + 1] - vocab_off[i]);
    if (e->ignore_merges)
      e->vocab.emplace(std::string((const char*)vocab_bytes + vocab_off[i], vocab_off[i + 1] - vocab_off[i]),
                       vocab_ids[i]);
  }
  e->merges.reserve((size_t)n_merges * 2);
  for (int64_t r = 0; r < n_merges; ++r) {
    uint64_t key = (uint64_t)(uint32_t)merges[3 * r] << 32 | (uint32_t)merges[3 * r + 1];
    e->merges.emplace(key, (uint64_t)r << 32 | (uint32_t)merges[3 * r + 2]);  // first (lowest) rank wins
  }
  for (int64_t i = 0; i < n_special; ++i) {
    e->special.emplace_back((const char*)special_bytes + special_off[i], special_off[i + 1] - special_off[i]);
    e->special_id.push_back(special_ids[i]);
    e->special_norm.push_back(special_norm[i] ? 1 : 0);
    if (!e->special.back().empty()) e->special_first[e->special_norm.back()][(uint8_t)e->special.back()[0]] = true;
  }
  return e;
}

void ftlib_bpe_free(void* h) { delete static_cast<Encoder*>(h); }

// Encode n_texts texts (UTF-8, text bytes [text_off[i], text_off[i+1])). Writes ids, char offsets
// (start, end per token, within its text) and per-text token counts; capacity >= total bytes suffices.
// Returns the number of tokens, or -1 if capacity is too small.
int64_t ftlib_bpe_encode(void* h, const uint8_t* text, const int64_t* text_off, int64_t n_texts, int32_t* out_ids,
                         int64_t* out_offs, int64_t* counts, int64_t capacity) {
  Encoder& e = *static_cast<Encoder*>(h);
  int64_t total = 0;
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < n_texts; ++t) {
    const int64_t a = text_off[t], b = text_off[t + 1];
    e.decode(text, a, b);
    const size_t n = e.cps.size();
    const int64_t start_total = total;
    auto emit_piece = [&](size_t pa, size_t pb) {  // pre-tokenize and encode chars [pa, pb)
      size_t k = pa;
      while (k < pb) {
        size_t end = e.next_pretoken(k, pb);  // chars are indexed in the whole text; pb ends the piece
        const int64_t bs = e.boff[k], be = e.boff[end];
        ids.clear();
        e.bpe(text + bs, (size_t)(be - bs), ids);
        if (total + (int64_t)ids.size() > capacity) return false;
        int64_t pos = bs;   // byte position of the current token's start
        size_t ch = k;      // char containing byte pos
        for (int32_t id : ids) {
          int64_t len = (id >= 0 && (size_t)id < e.token_len.size()) ? e.token_len[id] : 1;
          int64_t tend = pos + len;
          while (e.boff[ch + 1] <= pos) ++ch;
          size_t ce = ch;
          while (e.boff[ce + 1] < tend) ++ce;
          out_ids[total] = id;
          out_offs[2 * total] = (int64_t)ch;
          out_offs[2 * total + 1] = (int64_t)ce + 1;
          ++total;
          pos = tend;
        }
        k = end;
      }
      return true;
    };
    // added tokens: leftmost-longest, first those matched on the raw text (normalized=false), then,
    // inside the pieces between them, those matched on the normalized text (the text is normalized)
    auto split = [&](size_t pa, size_t pb, int pass, auto&& inner) -> bool {
      size_t piece = pa;
      for (size_t i = pa; i < pb;) {
        size_t match = 0, sid = 0;
        if (e.special_first[pass][text[e.boff[i]]]) {
          const int64_t room = e.boff[pb] - e.boff[i];
          for (size_t s = 0; s < e.special.size(); ++s) {  // longest first
            const std::string& sp = e.special[s];
            if (e.special_norm[s] == pass && (int64_t)sp.size() <= room &&
                std::memcmp(text + e.boff[i], sp.data(), sp.size()) == 0) { match = sp.size(); sid = s; break; }
          }
        }
        if (!match) { ++i; continue; }
        if (piece < i && !inner(piece, i)) return false;
        size_t j = i;
        while (e.boff[j] < e.boff[i] + (int64_t)match) ++j;
        if (total + 1 > capacity) return false;
        out_ids[total] = e.special_id[sid];
        out_offs[2 * total] = (int64_t)i;
        out_offs[2 * total + 1] = (int64_t)j;
        ++total;
        i = piece = j;
      }
      return piece < pb ? inner(piece, pb) : true;
    };
    auto normalized_pass = [&](size_t pa, size_t pb) { return split(pa, pb, 1, emit_piece); };
    if (!split(0, n, 0, normalized_pass)) return -1;
    counts[t] = total - start_total;
  }
  return total;
}

}  // extern "C"
