// SLURM's compressed host lists, as `srun` hands them to a job's tasks
// (SLURM_JOB_NODELIST). Communicator::from_env takes the first host as
// MASTER_ADDR when a job is started by SLURM without a launcher.
#pragma once

#include <string>
#include <vector>

namespace contrax {

/// Expands a SLURM host list: "node[01-03,07],gpu5" gives node01, node02,
/// node03, node07, gpu5 (zero padding kept, several bracket groups allowed).
///
///   auto hosts = contrax::expand_slurm_nodelist(std::getenv("SLURM_JOB_NODELIST"));
std::vector<std::string> expand_slurm_nodelist(const std::string& list);

}  // namespace contrax
