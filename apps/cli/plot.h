// Drawing a run's curves: RUN_DIR/curves.png from RUN_DIR/metrics.jsonl by
// tools/plot_run.py with python3 and matplotlib (`contrax plot`, and
// `contrax train` at the end of a run).
#pragma once

#include <string>

namespace contrax::cli {

/// The plotting script: next to the executable (copied there by the build),
/// in ../share/contrax (installed), or $CONTRAX_PLOT_SCRIPT. Empty if none.
std::string plot_script();

/// Draws DIR/curves.png from DIR/metrics.jsonl with python3 + matplotlib.
/// Returns 0 on success; otherwise prints why (matplotlib missing: how to
/// install it) and returns the script's status.
int plot_run(const std::string& dir, bool quiet);

}  // namespace contrax::cli
