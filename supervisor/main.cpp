// megacpp: the user's entry point.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <kj/exception.h>
#include <CLI/CLI.hpp>

#include "checkpoint/export.h"
#include "checkpoint/reader.h"
#include "checkpoint/verify.h"
#include "core/error.h"
#include "core/util.h"
#include "ipc/job_keys.h"
#include "prepare/prepare.h"
#include "recipes/plan.h"
#include "recipes/recipe.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/commands/commands.h"
#include "supervisor/supervisor.h"

namespace mc = megacpp;
namespace fs = std::filesystem;

namespace {

int verify(const fs::path& path) {
  const fs::path dir = mc::checkpoint::resolve_checkpoint_dir(path);
  auto result = mc::checkpoint::verify_checkpoint(dir);
  if (result.ok) {
    fmt::print("checkpoint {} verifies\n", dir.string());
    return 0;
  }
  fmt::print("checkpoint {} does NOT verify:\n", dir.string());
  for (const auto& p : result.problems) fmt::print("  - {}\n", p);
  return 1;
}

int cli(int argc, char** argv) {
  CLI::App app{
      "megacpp — trains language models as a supervised pipeline of cooperating processes"};
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("megacpp: error: {}\n", e.what());
  });

  mc::supervisor::RunOptions ro;
  std::string ro_run_dir, ro_data_dir;
  auto* run = app.add_subcommand("run", "Launch and supervise a training job on this node");
  run->add_option("recipe", ro.recipe, "Recipe name (in recipes/) or path to a .toml file")
      ->capture_default_str();
  run->add_option("--ranks", ro.ranks, "Trainer ranks (processes) on this node")
      ->capture_default_str();
  run->add_option("--steps", ro.steps, "Optimizer steps to train")->capture_default_str();
  auto* run_dir_opt =
      run->add_option("--run-dir", ro_run_dir, "Run directory to create (must not hold a run)");
  std::string ro_resume, ro_from;
  auto* resume_opt = run->add_option(
      "--resume", ro_resume,
      "Continue the run in this directory from its newest checkpoint that verifies (its recipe, "
      "steps and data; --ranks may change the world size, keeping the global batch)");
  auto* from_opt = run->add_option(
      "--from", ro_from,
      "Start this new run from a checkpoint (a step_N directory, or a run directory for its "
      "LATEST): parameters and optimizer state, training from the step after it");
  resume_opt->excludes(run_dir_opt)->excludes(from_opt);
  run->add_option("--data-dir", ro_data_dir,
                  "Data volume directory for token shards (default: <run-dir>/../data)");
  run->add_option("--mode", ro.mode,
                  "Override the recipe's mode: author_dp (tensor parallel 1) or nemo_native "
                  "(tensor parallel 2 with sequence parallelism)");
  run->add_option("--memory-budget", ro.memory_budget_gib,
                  "Refuse the launch when the plan needs more than this per rank (GiB)");
  run->add_option("--data-source", ro.data_source,
                  "Override the recipe's [data] source: builtin, llmc or megatron");
  run->add_option("--data-path", ro.data_path,
                  "Override the recipe's [data] path: shard directory, glob or Megatron dataset "
                  "prefix (relative to the working directory; a recipe's path is relative to "
                  "--data-dir)");
  run->add_option("--stage-data", ro.stage_data,
                  "Copy the dataset (a `megacpp prepare` directory) to this local directory, "
                  "verifying checksums and reusing unchanged files, and train from there");
  run->add_flag("--require-data-volume", ro.require_data_volume,
                "Refuse a run directory on the root volume (rule data-volume)");
  run->add_option("--heartbeat-ms", ro.heartbeat_interval_ms, "Heartbeat interval of every stage")
      ->capture_default_str();
  run->add_option("--ring-slots", ro.ring_slots, "Batch ring depth per rank")
      ->capture_default_str();
  run->add_option("--startup-budget-s", ro.startup_budget_s,
                  "Seconds a trainer may spend in one phase before its first step is done")
      ->capture_default_str();
  run->add_option("--hang-budget-s", ro.hang_budget_s,
                  "After the first step: the floor of a phase's budget (hung when exceeded)")
      ->capture_default_str();
  run->add_option("--hang-multiple", ro.hang_multiple,
                  "After the first step: a phase's budget is at least this x the median step time")
      ->capture_default_str();
  run->add_option("--heartbeat-timeout-s", ro.heartbeat_timeout_s,
                  "Silence after which a process is heartbeat_lost (capped by its phase budget)")
      ->capture_default_str();
  run->add_option("--collector-stall-s", ro.collector_stall_s,
                  "Restart the collector when it finishes no fold for this long")
      ->capture_default_str();
  run->add_option("--loader-stall-s", ro.loader_stall_s,
                  "Restart the data loader when it fills no ring that has room for this long")
      ->capture_default_str();
  run->add_option("--checkpointer-stall-s", ro.checkpointer_stall_s,
                  "Restart the checkpointer when its loop or write does not move for this long")
      ->capture_default_str();
  run->add_option("--max-restarts", ro.max_restarts,
                  "Restarts allowed per restartable stage (collector, data loader, checkpointer)")
      ->capture_default_str();
  run->add_option("--keep-checkpoints", ro.keep_checkpoints,
                  "Committed checkpoints to keep: older ones are deleted once a newer one is "
                  "committed (>= 1)")
      ->capture_default_str();
  run->add_option("--keep-every", ro.keep_every,
                  "Also keep every checkpoint whose step is a multiple of this (0: none)")
      ->capture_default_str();
  run->add_option("--metrics-addr", ro.metrics_addr,
                  "HOST:PORT for /metrics (port 0 = any free port)")
      ->capture_default_str();
  run->add_option("--metrics-linger-s", ro.metrics_linger_s,
                  "Keep serving /metrics this long after the run ends (for a last scrape)")
      ->capture_default_str();
  run->add_option("--max-job-restarts", ro.max_job_restarts,
                  "After a failure tears the job down, relaunch every stage from the newest "
                  "committed checkpoint, at most this many times (a failure repeating at the "
                  "same step is not retried)")
      ->capture_default_str();
  bool ro_no_spares = false;
  run->add_flag("--no-spare-trainers", ro_no_spares,
                "With job restarts left, start no spare trainer processes (loaded and waiting, "
                "so a restart need not start processes): restarts then start every rank anew");
  run->add_option("--stop-grace-s", ro.stop_grace_s,
                  "On SIGINT/SIGTERM: time to finish the step in flight and commit its "
                  "checkpoint before tearing down (a second signal tears down at once)")
      ->capture_default_str();
  run->add_option("--teardown-grace-s", ro.teardown_grace_s, "SIGTERM -> SIGKILL grace")
      ->capture_default_str();
  run->add_flag("--abort-collectives,!--no-abort-collectives", ro.abort_collectives,
                "A failed job's teardown aborts the ranks' process groups (NCCL communicators; "
                "Gloo waits) before any signal")
      ->capture_default_str();
  run->add_option("--abort-wait-s", ro.abort_wait_s,
                  "How long the teardown waits for the ranks' replies to the abort")
      ->capture_default_str();
  run->add_option("--device", ro.device,
                  "cpu (Gloo) or cuda (rank r on CUDA device r, NCCL; needs the CUDA plugin and "
                  "one visible device per rank)")
      ->capture_default_str();
  run->add_flag("--malloc-tuning,!--no-malloc-tuning", ro.malloc_tuning,
                "Trainers' malloc uses transparent huge pages and a fixed mmap threshold "
                "(GLIBC_TUNABLES; a tunable already set keeps its value): a faster first step "
                "after a (re)launch and a faster teardown")
      ->capture_default_str();
  run->add_option("--progress", ro.progress, "Console progress: auto | tty | plain | none")
      ->capture_default_str();
  // A node's place in a job (DESIGN.md "Joining a job across nodes"): taken as text, so a bad
  // value is refused in the same words as a bad variable of the engine's.
  std::string ro_nodes, ro_node_rank, ro_master, ro_iface;
  auto* nodes_opt = run->add_option("--nodes", ro_nodes,
                                    "Nodes in the job, one `megacpp run` on each (default: the "
                                    "engine's, Slurm, torchrun or "
                                    "Kubernetes MEGACPP_NODES; else 1)")
                        ->type_name("N");
  auto* node_rank_opt =
      run->add_option("--node-rank", ro_node_rank,
                      "This node's place in the job, 0..nodes-1 (default: the engine's)")
          ->type_name("R");
  auto* master_opt =
      run->add_option("--master", ro_master,
                      "ADDR[:PORT] of node 0 (default: the engine's MASTER_ADDR/MASTER_PORT, or "
                      "Slurm's first host; port MEGACPP_MASTER_PORT, else 29500)")
          ->type_name("ADDR[:PORT]");
  auto* iface_opt =
      run->add_option(
             "--iface", ro_iface,
             "Network interface for traffic between nodes (default: GLOO_SOCKET_IFNAME, else "
             "NCCL_SOCKET_IFNAME)")
          ->type_name("NAME");
  run->add_option("--job-keys", ro.job_keys,
                  "The job's key file (`megacpp keys FILE`), the same on every node of a job "
                  "across nodes; mode 0600")
      ->type_name("FILE");
  bool ro_detach = false;
  run->add_flag("--detach", ro_detach,
                "Return once the stage graph is up; the supervisor goes on in its own session, "
                "logging to RUN/logs/supervisor.log (watch it with `megacpp status RUN --watch`, "
                "stop it with `megacpp stop RUN`)");

  fs::path status_dir;
  auto* status =
      app.add_subcommand("status", "Print a run's manifest: state, first failure, stages");
  status->add_option("run-dir", status_dir, "Run directory")->required();
  bool status_watch = false;
  double status_interval = 2.0;
  status->add_flag("--watch", status_watch,
                   "While the run is live, one progress line (step, loss, tokens/s, stages up, "
                   "ETA) every --interval seconds; then its status");
  status->add_option("--interval", status_interval, "Seconds between --watch lines")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();

  fs::path stop_dir;
  bool stop_wait = false;
  double stop_timeout = 300;
  auto* stop_cmd = app.add_subcommand(
      "stop",
      "Ask a live run's supervisor to stop gracefully (as SIGTERM: the step in flight "
      "is checkpointed)");
  stop_cmd->add_option("run-dir", stop_dir, "Run directory")->required();
  stop_cmd->add_flag("--wait", stop_wait, "Wait until the supervisor is gone, then print status");
  stop_cmd->add_option("--timeout", stop_timeout, "Seconds --wait waits")
      ->check(CLI::Range(1.0, 86400.0))
      ->capture_default_str();

  std::vector<fs::path> compare_dirs;
  bool compare_force = false;
  auto* compare_cmd =
      app.add_subcommand("compare",
                         "Runs of one comparison class side by side: tokens/s, step time p50/p99, "
                         "checkpoint stall, restarts, loss at matching steps");
  compare_cmd->add_option("runs", compare_dirs, "Run directories (two or more)")->required();
  compare_cmd->add_flag("--force", compare_force,
                        "Print runs of different classes too, labelled as a cross-class "
                        "comparison");

  std::vector<fs::path> report_dirs;
  fs::path report_out;
  auto* report_cmd = app.add_subcommand(
      "report",
      "One self-contained HTML page of runs: loss and tokens/s plots, state, stages, "
      "first failure");
  report_cmd->add_option("runs", report_dirs, "Run directories")->required();
  report_cmd->add_option("--out", report_out, "Folder for index.html")->required();

  fs::path list_dir;
  auto* list_cmd = app.add_subcommand(
      "list", "Every run under a folder: state, recipe, steps, last loss, started, duration");
  list_cmd->add_option("dir", list_dir, "Folder of run directories")->required();

  std::vector<fs::path> collect_dirs;
  auto* collect = app.add_subcommand(
      "collect", "Re-fold runs' journals into manifest and receipts (idempotent)");
  fs::path collect_all_dir;
  unsigned collect_jobs = std::max(1u, std::thread::hardware_concurrency());
  auto* collect_dirs_opt = collect->add_option("run-dirs", collect_dirs, "Run directories");
  auto* collect_all_opt = collect->add_option(
      "--all", collect_all_dir,
      "Every run directly under this folder or one folder below, in parallel, with a summary");
  collect_all_opt->excludes(collect_dirs_opt);
  collect->add_option("--jobs", collect_jobs, "Threads for --all")
      ->check(CLI::Range(1u, 1024u))
      ->capture_default_str();

  std::string plan_recipe = "tiny", plan_mode;
  uint32_t plan_ranks = 1;
  double plan_budget = 0;
  std::string plan_device = "cpu";
  auto* plan = app.add_subcommand(
      "plan",
      "Print a recipe expanded under a mode and a world: every layer's block, parameters per "
      "family, total and active parameters, per-rank memory, the gates and the hash");
  plan->add_option("recipe", plan_recipe, "Recipe name or path")->capture_default_str();
  plan->add_option("--mode", plan_mode, "author_dp | nemo_native (default: the recipe's)");
  plan->add_option("--ranks", plan_ranks, "World size to plan for")->capture_default_str();
  plan->add_option("--memory-budget", plan_budget,
                   "Per-rank memory in GiB the memory-budget gate checks (default: unchecked)");
  plan->add_option("--device", plan_device, "cpu | cuda: the device the feature-built gate checks")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();

  fs::path keys_path;
  auto* keys_cmd = app.add_subcommand(
      "keys", "Write fresh keys for a job across nodes (0600; give every node the same file)");
  keys_cmd->add_option("file", keys_path, "The key file to create (must not exist)")->required();

  fs::path verify_path;
  auto* verify_cmd =
      app.add_subcommand("verify", "Verify a checkpoint directory (or a run's LATEST checkpoint)");
  verify_cmd->add_option("path", verify_path, "Checkpoint directory or run directory")->required();

  fs::path export_path, export_out;
  bool export_optimizer = false;
  auto* export_cmd = app.add_subcommand(
      "export", "Write a checkpoint's model parameters as one safetensors file (PyTorch names)");
  export_cmd->add_option("checkpoint", export_path, "Checkpoint directory or run directory")
      ->required();
  export_cmd->add_option("--out", export_out, "The .safetensors file to write")->required();
  export_cmd->add_flag("--optimizer", export_optimizer,
                       "Include the optimizer state, reassembled per parameter");

  mc::prepare::PrepareConfig pc;
  std::string pc_tokenizer, pc_model_type = "bpe", pc_progress = "auto";
  fs::path pc_stage_to;
  bool pc_byte_level = false;
  auto* prep = app.add_subcommand(
      "prepare", "Tokenize files or folders of UTF-8 text into llm.c shards and dataset.json");
  prep->add_option("inputs", pc.inputs, "Files or folders of UTF-8 text (folders are recursed)")
      ->required();
  prep->add_option("--out", pc.out_dir, "Dataset directory to write (new or empty)")->required();
  auto* prep_tok = prep->add_option("--tokenizer", pc_tokenizer,
                                    "Tokenize with this SentencePiece .model (EOS = its eos_id)");
  auto* prep_vocab = prep->add_option("--vocab-size", pc.vocab_size,
                                      "Train a SentencePiece tokenizer of this vocabulary size");
  prep->add_option("--model-type", pc_model_type, "SentencePiece model to train: bpe | unigram")
      ->check(CLI::IsMember({"bpe", "unigram"}))
      ->needs(prep_vocab)
      ->capture_default_str();
  auto* prep_byte = prep->add_flag("--byte-level", pc_byte_level,
                                   "Byte-level tokens: ids 0..255, EOS 256 (the default)");
  prep_tok->excludes(prep_vocab)->excludes(prep_byte);
  prep_vocab->excludes(prep_byte);
  prep->add_option("--threads", pc.threads, "Tokenizing threads (default: hardware threads)");
  prep->add_option("--shard-tokens", pc.shard_tokens, "Tokens per shard")->capture_default_str();
  prep->add_option("--val-every", pc.val_every,
                   "Every K-th document goes to the val split (0: no val split)")
      ->capture_default_str();
  prep->add_option("--stage-to", pc_stage_to,
                   "Then copy the dataset to this (hot) directory, verifying every file");
  prep->add_option("--progress", pc_progress, "Progress on stderr: auto | tty | plain | none")
      ->check(CLI::IsMember({"auto", "tty", "plain", "none"}))
      ->capture_default_str();

  auto* stress = app.add_subcommand("stress-optimizer",
                                    "Run the distributed-optimizer stress harness "
                                    "(megacpp-stress-optimizer; its --help lists the options)");
  stress->allow_extras();
  stress->prefix_command();
  stress->set_help_flag();  // --help goes to the harness, which lists its own options

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error is 2, as README.md promises.
    return app.exit(e) == 0 ? 0 : 2;
  }

  try {
    if (*run) {
      ro.run_dir = ro_run_dir;
      ro.data_dir = ro_data_dir;
      ro.resume = ro_resume;
      ro.from = ro_from;
      if (!ro_resume.empty()) {
        // A resumed run trains what it recorded: these would silently change it.
        for (const char* name : {"recipe", "--steps", "--data-dir", "--data-source", "--data-path",
                                 "--stage-data", "--mode"}) {
          if (run->count(name) > 0)
            throw mc::Error(mc::ErrorKind::kInvalidArgument,
                            fmt::format("--resume continues the run as it was launched: drop {} "
                                        "(branch with --from to change it)",
                                        name));
        }
        if (run->count("--ranks") == 0) ro.ranks = 0;
      }
      if (*nodes_opt) ro.placement.nodes = ro_nodes;
      if (*node_rank_opt) ro.placement.node_rank = ro_node_rank;
      if (*master_opt) ro.placement.master = ro_master;
      if (*iface_opt) ro.placement.iface = ro_iface;
      ro.spare_trainers = !ro_no_spares;
      ro.argv.assign(argv, argv + argc);
      return ro_detach ? mc::supervisor::run_detached(ro) : mc::supervisor::run(ro);
    }
    if (*status)
      return status_watch ? mc::supervisor::watch_status(status_dir, status_interval)
                          : mc::supervisor::status(status_dir);
    if (*stop_cmd) return mc::supervisor::stop(stop_dir, stop_wait, stop_timeout);
    if (*list_cmd) return mc::supervisor::list_runs(list_dir);
    if (*compare_cmd) return mc::supervisor::compare_runs(compare_dirs, compare_force);
    if (*report_cmd) return mc::supervisor::write_report(report_dirs, report_out);
    if (*collect) {
      if (!collect_all_dir.empty())
        return mc::supervisor::collect_all(collect_all_dir, collect_jobs);
      if (collect_dirs.empty())
        throw mc::Error(mc::ErrorKind::kInvalidArgument,
                        "collect needs run directories, or --all DIR");
      for (const auto& d : collect_dirs) {
        if (!fs::exists(mc::layout::launch_path(d)))
          throw mc::Error(mc::ErrorKind::kInvalidArgument,
                          fmt::format("{} holds no run (no launch.json)", d.string()));
        mc::supervisor::reconcile(d);
        mc::collector::collect_run(d);
        fmt::print("collected {}\n", d.string());
      }
      return 0;
    }
    if (*plan) {
      auto r = mc::recipe::load(mc::recipe::resolve(plan_recipe, MEGACPP_RECIPE_DIR));
      if (!plan_mode.empty()) {
        r.model.mode = plan_mode;
        r = mc::recipe::rehash(std::move(r));
      }
      const std::string precision =
          mc::recipe::resolve_muon_precision(r, plan_device, mc::cpu_bf16_units());
      fmt::print("{}\n", mc::recipe::describe(r));
      fmt::print("muon orthogonalization: {}\n", precision);
      mc::recipe::PlanOptions po{.ranks = plan_ranks,
                                 .memory_budget_gib = plan_budget,
                                 .device = plan_device,
                                 .cuda_trainer_built = mc::supervisor::cuda_trainer_built()};
      mc::supervisor::set_snapshot_staging_options(po);
      // --device cuda checks the budget by default: the device's memory, as `run` does.
      if (plan_device == "cuda")
        mc::supervisor::default_cuda_memory_budget(po.memory_budget_gib, po.memory_budget_source);
      const auto p = mc::recipe::make_plan(r, po);
      fmt::print("{}", mc::recipe::format_plan(p));
      // A plan `megacpp run` would refuse exits 1 (a script gates a launch on it); usage errors
      // stay 2.
      return p.refusal() != nullptr ? 1 : 0;
    }
    if (*verify_cmd) return verify(verify_path);
    if (*keys_cmd) {
      mc::ipc::write_job_keys(keys_path, mc::ipc::generate_job_keys());
      fmt::print(
          "wrote the job's keys to {}: give every node of the job this file "
          "(`megacpp run --job-keys {}`), readable by the job's user only\n",
          keys_path.string(), keys_path.string());
      return 0;
    }
    if (*export_cmd) {
      const fs::path dir = mc::checkpoint::resolve_checkpoint_dir(export_path);
      const auto verdict = mc::checkpoint::verify_checkpoint(dir);
      if (!verdict.ok)
        throw mc::Error(mc::ErrorKind::kInvalidArgument,
                        fmt::format("{} does not verify ({}): export another checkpoint",
                                    dir.string(), verdict.problems.front()));
      const mc::checkpoint::CheckpointReader ckpt(dir);
      mc::checkpoint::ExportReport report;
      try {
        report = mc::checkpoint::export_checkpoint(ckpt, export_out, export_optimizer);
      } catch (const mc::Error& e) {
        // The checkpoint verified: a failed OS call here is about --out (its directory, its
        // space), which the user chooses.
        if (e.kind() != mc::ErrorKind::kSystem) throw;
        MEGACPP_FAIL_LIKE(e, "export: {}; pass --out a file in a writable directory with room",
                          e.message());
      }
      fmt::print("exported step {} of run {} ({} ranks): {} tensors, {:.1f} MB -> {}\n",
                 ckpt.step(), ckpt.run_id(), ckpt.world(), report.tensors, report.bytes / 1e6,
                 export_out.string());
      return 0;
    }
    if (*prep) {
      namespace pp = mc::prepare;
      if (*prep_tok) {
        pc.tokenizer = pp::TokenizerMode::kLoad;
        pc.tokenizer_model = pc_tokenizer;
      } else if (*prep_vocab) {
        pc.tokenizer = pp::TokenizerMode::kTrain;
        pc.model_type = pc_model_type == "unigram" ? pp::ModelType::kUnigram : pp::ModelType::kBpe;
      }
      if (!pc_stage_to.empty()) pc.stage_to = pc_stage_to;
      pc.progress = pc_progress == "tty"     ? pp::ProgressMode::kTty
                    : pc_progress == "plain" ? pp::ProgressMode::kPlain
                    : pc_progress == "none"  ? pp::ProgressMode::kNone
                                             : pp::ProgressMode::kAuto;
      mc::set_log_prefix("prepare");
      fmt::print("{}\n", pp::summary_line(pp::prepare(pc)));
      return 0;
    }
    if (*stress) {
      // The harness links torch and forks Gloo ranks: it is its own executable next to this one.
      auto exe = fs::read_symlink("/proc/self/exe").parent_path() / "megacpp-stress-optimizer";
      std::vector<std::string> args = {exe.string()};
      for (const auto& a : stress->remaining()) args.push_back(a);
      std::vector<char*> cargs;
      for (auto& a : args) cargs.push_back(a.data());
      cargs.push_back(nullptr);
      std::fflush(stdout);
      ::execv(cargs[0], cargs.data());
      throw mc::Error(mc::ErrorKind::kSystem,
                      fmt::format("cannot run {}: {}", exe.string(), std::strerror(errno)));
    }
  } catch (const mc::Error& e) {
    // The user's line only: the failed expression and source location (e.what()) belong in
    // logs and failure dumps, not on the terminal.
    std::fflush(stdout);
    fmt::print(stderr, "megacpp: error: {}\n", e.message());
    return e.kind() == mc::ErrorKind::kInvalidArgument ? 2 : 1;
  } catch (const kj::Exception& e) {
    fmt::print(stderr, "megacpp: error: {}\n", e.getDescription().cStr());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "megacpp: error: {}\n", e.what());
    return 1;
  }
  return 0;
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

}  // namespace

// Every object of the command is destroyed, its files written and closed, before cli()
// returns; what is left is the process's exit. A run loaded libtorch with the store plugin
// (rendezvous.cpp), whose exit-time destructors take about 0.1 s of a core (measured: a
// program that only dlopens libmegacpp_store.so spends 0.09 s after main returns), after the
// run's outcome is decided and reported. The process ends without them, so an engine
// (torchrun, srun) sees a node's end when its work is done. Sanitizer builds exit normally:
// their leak and race reports run at exit.
int main(int argc, char** argv) {
  const int rc = cli(argc, argv);
  if (kSanitized) return rc;
  std::fflush(nullptr);
  ::_exit(rc);
}
