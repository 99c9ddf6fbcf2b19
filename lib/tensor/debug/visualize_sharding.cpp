// visualize_sharding: the block table of a 1-D or 2-D DTensor ([Note: visualize_sharding]).
#include <dtensor/visualize_sharding.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <utility>
#include <vector>

#include <dtensor/dtensor.h>

#include "internal/check.h"

namespace dtensor {

namespace {

using Range = std::pair<int64_t, int64_t>; // first and last index, inclusive

// One line of tabulate's "simple" table: cells left-aligned to their column's width, two
// spaces between columns, no trailing blanks.
std::string table_line(const std::vector<std::string>& cells, const std::vector<size_t>& widths) {
  std::string line;
  for (size_t c = 0; c < cells.size(); ++c) {
    line += (c ? "  " : "") + cells[c] + std::string(widths[c] - cells[c].size(), ' ');
  }
  line.erase(line.find_last_not_of(' ') + 1);
  return line;
}

// tabulate(matrix, headers=col_headers, showindex=row_headers): a column is as wide as its
// widest cell and at least its header plus two; the index column's header is empty.
std::string simple_table(const std::vector<std::string>& col_headers,
                         const std::vector<std::string>& row_headers,
                         const std::vector<std::vector<std::string>>& matrix) {
  std::vector<std::string> head{""};
  head.insert(head.end(), col_headers.begin(), col_headers.end());
  std::vector<size_t> widths(head.size());
  for (size_t c = 0; c < head.size(); ++c) {
    widths[c] = head[c].size() + 2;
    for (size_t r = 0; r < row_headers.size(); ++r) {
      widths[c] = std::max(widths[c], c == 0 ? row_headers[r].size() : matrix[r][c - 1].size());
    }
  }
  std::vector<std::string> dashes;
  for (size_t w : widths) {
    dashes.emplace_back(w, '-');
  }
  std::string out = table_line(head, widths) + "\n" + table_line(dashes, widths);
  for (size_t r = 0; r < row_headers.size(); ++r) {
    std::vector<std::string> cells{row_headers[r]};
    cells.insert(cells.end(), matrix[r].begin(), matrix[r].end());
    out += "\n" + table_line(cells, widths);
  }
  return out;
}

std::vector<std::string> range_headers(const char* what, const std::vector<Range>& ranges) {
  std::vector<std::string> out;
  for (const auto& [first, last] : ranges) {
    out.push_back(fmt::format("{} {}-{}", what, first, last));
  }
  return out;
}

} // namespace

std::string sharding_table(const at::Tensor& tensor) {
  DTENSOR_CHECK(is_dtensor(tensor), "visualize_sharding: a plain tensor (shape {}) has no sharding",
                tensor.sizes());
  const DTensorSpec& spec = DTensor(tensor).spec();
  DTENSOR_CHECK(spec.ndim() == 1 || spec.ndim() == 2,
                "visualize_sharding supports only 1-D or 2-D DTensors, not shape {} ({})",
                spec.shape, spec.to_string());
  if (tensor.numel() == 0) {
    return "";
  }
  const DeviceMesh& mesh = spec.mesh;
  // Every rank's block, in mesh order: (rows, cols, global rank).
  std::vector<std::pair<std::pair<Range, Range>, int>> blocks;
  for (size_t i = 0; i < mesh.ranks().size(); ++i) {
    std::vector<int64_t> coord(mesh.shape().size());
    for (size_t d = coord.size(), rest = i; d-- > 0;) {
      coord[d] = static_cast<int64_t>(rest) % mesh.shape()[d];
      rest /= static_cast<size_t>(mesh.shape()[d]);
    }
    auto shape = spec.local_shape(coord);
    auto offset = spec.local_offset(coord);
    if (shape.size() == 1) { // a 1-D tensor is one column
      shape.push_back(1);
      offset.push_back(0);
    }
    blocks.push_back({{{offset[0], offset[0] + shape[0] - 1}, {offset[1], offset[1] + shape[1] - 1}},
                      mesh.ranks()[i]});
  }
  std::vector<Range> rows, cols;
  for (const auto& [ranges, rank] : blocks) {
    rows.push_back(ranges.first);
    cols.push_back(ranges.second);
  }
  for (auto* v : {&rows, &cols}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  const std::string device = c10::DeviceTypeName(mesh.device_type(), /*lower_case=*/true);
  std::vector<std::vector<std::string>> matrix(rows.size(), std::vector<std::string>(cols.size()));
  for (const auto& [ranges, rank] : blocks) {
    auto r = std::lower_bound(rows.begin(), rows.end(), ranges.first) - rows.begin();
    auto c = std::lower_bound(cols.begin(), cols.end(), ranges.second) - cols.begin();
    std::string& cell = matrix[static_cast<size_t>(r)][static_cast<size_t>(c)];
    cell += cell.empty() ? fmt::format("{}:{}", device, rank) : fmt::format(",{}", rank);
  }
  return simple_table(range_headers("Col", cols), range_headers("Row", rows), matrix);
}

void visualize_sharding(const at::Tensor& tensor, const std::string& header) {
  const std::string table = sharding_table(tensor);
  const auto coord = DTensor(tensor).device_mesh().get_coordinate();
  const bool first = coord && std::all_of(coord->begin(), coord->end(),
                                          [](int64_t c) { return c == 0; });
  if (table.empty() || !first) {
    return;
  }
  if (!header.empty()) {
    std::cout << header << "\n";
  }
  std::cout << table << std::endl;
}

} // namespace dtensor
