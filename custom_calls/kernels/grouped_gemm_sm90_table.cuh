// The plain (CUTLASS-free) head of the grouped GEMM's workspace: what the
// setup kernel derives from group_sizes and the fill kernel reads. The
// CUTLASS-typed per-group arrays follow it (grouped_gemm_sm90_impl.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

namespace te_jax {
namespace sm90 {

enum GroupStatus : int32_t { kGroupOk = 0, kGroupEmpty = 1, kGroupInvalid = 2 };

// Carved from the workspace start: bounds[G + 1] (group g covers
// [bounds[g], bounds[g+1]) of its axis, clamped to the buffer), status[G],
// and any_invalid (1 when some group is kGroupInvalid).
struct GroupTable {
  int64_t* bounds;
  int32_t* status;
  int32_t* any_invalid;
};

constexpr size_t kWorkspaceAlign = 256;
inline size_t AlignUp(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

inline size_t GroupTableBytes(int64_t groups) {
  return AlignUp(sizeof(int64_t) * (groups + 1) + sizeof(int32_t) * (groups + 1));
}
inline GroupTable CarveGroupTable(void* workspace, int64_t groups) {
  char* p = static_cast<char*>(workspace);
  GroupTable t;
  t.bounds = reinterpret_cast<int64_t*>(p);
  t.status = reinterpret_cast<int32_t*>(p + sizeof(int64_t) * (groups + 1));
  t.any_invalid = t.status + groups;
  return t;
}

}  // namespace sm90
}  // namespace te_jax
