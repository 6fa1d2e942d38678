// Best-fit-decreasing bin assignment for ftlib.data.packing (C++ path; the NumPy path in
// packing.py is the reference and must give identical output).
//
// Input: item lengths already in placement order (sorted by length decreasing, ties by item
// index ascending), each in [1, capacity]. Each item goes to the open bin with the smallest
// remaining capacity that still fits it; among bins with equal remaining capacity the lowest
// bin id wins; with no such bin a new bin (next id) is opened. Output: bin id per item.
//
// Data structures: one min-heap of bin ids per remaining capacity 1..capacity, and an ordered
// set of the capacities whose heap is non-empty, so each placement is O(log capacity + log n).
// Only the heap top is ever removed (it is the chosen bin), so no lazy deletion is needed.
#include <cstdint>
#include <functional>
#include <queue>
#include <set>
#include <vector>

extern "C" int64_t ftlib_bfd_assign(const int64_t* lengths, int64_t n, int64_t capacity, int64_t* out_bin) {
  if (capacity < 1) return -1;
  using MinHeap = std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>>;
  std::vector<MinHeap> heaps(static_cast<size_t>(capacity) + 1);
  std::set<int64_t> nonempty;
  int64_t n_bins = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = lengths[i];
    if (len < 1 || len > capacity) return -2 - i;  // caller reports the offending item
    auto it = nonempty.lower_bound(len);
    int64_t bin, remaining;
    if (it == nonempty.end()) {
      bin = n_bins++;
      remaining = capacity - len;
    } else {
      const int64_t cap = *it;
      bin = heaps[cap].top();
      heaps[cap].pop();
      if (heaps[cap].empty()) nonempty.erase(it);
      remaining = cap - len;
    }
    out_bin[i] = bin;
    if (remaining > 0) {
      if (heaps[remaining].empty()) nonempty.insert(remaining);
      heaps[remaining].push(bin);
    }
  }
  return n_bins;
}
