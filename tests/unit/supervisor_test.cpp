// The supervisor's failure policy (supervisor/failure_policy.h), one rule per case. Each table
// row states a rule in words and the observations that exercise it; the expectation is what a
// user reads in the manifest (who is the first failure, who is a victim, what is restarted).
#include <gtest/gtest.h>
#include <signal.h>

#include <cctype>
#include <map>
#include <string>
#include <vector>

#include "supervisor/failure_policy.h"

using namespace megacpp::supervisor::policy;
using megacpp::schema::ErrorKind;
using megacpp::schema::FailureKind;
using megacpp::schema::Phase;
using megacpp::schema::StageKind;

namespace {

constexpr int64_t kS = 1'000'000'000;  // one second in ns

Event ev(FailureKind kind, double evidence_s, ErrorKind error = ErrorKind::NONE,
         bool own_progress = false) {
  Event e;
  e.kind = kind;
  e.evidence_ns = static_cast<int64_t>(evidence_s * kS);
  e.detected_ns = e.evidence_ns + kS;
  e.error_kind = error;
  e.own_progress = own_progress;
  return e;
}

// A test name from a rule's words: "a rank blocked on ..." -> "ARankBlockedOn..." (ctest shows
// the rule, not an index).
std::string rule_name(const char* rule) {
  std::string out;
  bool upper = true;
  for (const char* c = rule; *c != '\0' && out.size() < 72; ++c) {
    if (std::isalnum(static_cast<unsigned char>(*c))) {
      out += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(*c))) : *c;
      upper = false;
    } else if (*c == '\'') {
      continue;  // "process's" -> "Processs", not "ProcessS"
    } else if (*c == ':') {
      break;
    } else {
      upper = true;
    }
  }
  return out;
}

template <typename Case>
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return rule_name(info.param.rule);
}

Budgets budgets() {
  Budgets b;
  b.startup_s = 300;
  b.hang_s = 30;
  b.hang_multiple = 20;
  b.heartbeat_timeout_s = 10;
  b.heartbeat_interval_s = 0.2;
  b.collector_stall_s = 30;
  b.loader_stall_s = 30;
  b.checkpointer_stall_s = 60;
  return b;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Roles: which event names the first failure.

struct RolesCase {
  const char* rule;
  std::map<std::string, Event> events;
  std::vector<std::string> exited_abnormally;
  std::string first_failure;
  std::vector<std::string> victims;
  std::vector<std::string> torn_down;
};
void PrintTo(const RolesCase& c, std::ostream* os) {
  *os << c.rule;
}

class Roles_ : public ::testing::TestWithParam<RolesCase> {};

TEST_P(Roles_, AssignsTheRoles) {
  const RolesCase& c = GetParam();
  const Roles r = assign_roles(c.events, c.exited_abnormally);
  EXPECT_EQ(r.first_failure, c.first_failure) << c.rule;
  EXPECT_EQ(r.victims, c.victims) << c.rule;
  EXPECT_EQ(r.torn_down, c.torn_down) << c.rule;
}

INSTANTIATE_TEST_SUITE_P(
    FailurePolicy, Roles_,
    ::testing::Values(
        RolesCase{"a rank blocked on a stopped peer is a victim: the peer's silence names it, "
                  "even though the rank's timeout claim came earlier",
                  {{"trainer-0", ev(FailureKind::EXCEPTION, 1.0, ErrorKind::TIMEOUT)},
                   {"trainer-1", ev(FailureKind::HEARTBEAT_LOST, 2.0)}},
                  {"trainer-0"},
                  "trainer-1",
                  {"trainer-0"},
                  {}},
        RolesCase{"a rank whose collective failed because a peer died is a victim",
                  {{"trainer-0", ev(FailureKind::EXCEPTION, 0.5, ErrorKind::PEER_FAILURE)},
                   {"trainer-1", ev(FailureKind::SIGNALED, 3.0)}},
                  {"trainer-0", "trainer-1"},
                  "trainer-1",
                  {"trainer-0"},
                  {}},
        RolesCase{"a hang counts only when nothing died first: the death names the failure "
                  "even when the hang's evidence is older",
                  {{"trainer-0", ev(FailureKind::HUNG, 0.0)},
                   {"trainer-1", ev(FailureKind::EXITED, 5.0)}},
                  {"trainer-1"},
                  "trainer-1",
                  {"trainer-0"},
                  {}},
        RolesCase{"a hang is the first failure when nothing died or went silent",
                  {{"trainer-0", ev(FailureKind::HUNG, 4.0)},
                   {"trainer-1", ev(FailureKind::EXCEPTION, 1.0, ErrorKind::TIMEOUT)}},
                  {"trainer-1"},
                  "trainer-0",
                  {"trainer-1"},
                  {}},
        RolesCase{"a stage's own watchdog (its working thread stalled) is evidence of its own, "
                  "not a hang that may be waiting on another",
                  {{"collector-0", ev(FailureKind::HUNG, 6.0, ErrorKind::NONE, true)},
                   {"trainer-0", ev(FailureKind::HUNG, 2.0)}},
                  {},
                  "collector-0",
                  {"trainer-0"},
                  {}},
        RolesCase{"a rank's own error (not a peer's) is its own evidence: earliest wins",
                  {{"trainer-0", ev(FailureKind::EXCEPTION, 2.0, ErrorKind::INTERNAL)},
                   {"trainer-1", ev(FailureKind::EXITED, 3.0)}},
                  {"trainer-0", "trainer-1"},
                  "trainer-0",
                  {"trainer-1"},
                  {}},
        RolesCase{"processes without an event that exited abnormally were torn down; a clean "
                  "exit has no role",
                  {{"trainer-1", ev(FailureKind::SIGNALED, 1.0)}},
                  {"trainer-1", "data_loader-0", "checkpointer-0"},
                  "trainer-1",
                  {},
                  {"data_loader-0", "checkpointer-0"}},
        RolesCase{"no event: the run did not fail, nobody has a role",
                  {},
                  {"data_loader-0"},
                  "",
                  {},
                  {}}),
    case_name<RolesCase>);

// ---------------------------------------------------------------------------------------
// Evidence classes and ordering.

struct EvidenceCase {
  const char* rule;
  Event event;
  Evidence evidence;
};
void PrintTo(const EvidenceCase& c, std::ostream* os) {
  *os << c.rule;
}

class Evidence_ : public ::testing::TestWithParam<EvidenceCase> {};

TEST_P(Evidence_, ClassifiesTheEvent) {
  EXPECT_EQ(evidence_of(GetParam().event), GetParam().evidence) << GetParam().rule;
}

INSTANTIATE_TEST_SUITE_P(
    FailurePolicy, Evidence_,
    ::testing::Values(EvidenceCase{"a death by exit is the process's own",
                                   ev(FailureKind::EXITED, 0), Evidence::kOwn},
                      EvidenceCase{"a death by signal is the process's own",
                                   ev(FailureKind::SIGNALED, 0), Evidence::kOwn},
                      EvidenceCase{"silence is the process's own",
                                   ev(FailureKind::HEARTBEAT_LOST, 0), Evidence::kOwn},
                      EvidenceCase{"a stage that starved its consumers is its own",
                                   ev(FailureKind::STALLED, 0), Evidence::kOwn},
                      EvidenceCase{"outliving SIGKILL is the process's own",
                                   ev(FailureKind::UNKILLABLE, 0), Evidence::kOwn},
                      EvidenceCase{"a hang in a phase may be waiting on another",
                                   ev(FailureKind::HUNG, 0), Evidence::kHang},
                      EvidenceCase{"a timeout thrown by a collective is a victim's claim",
                                   ev(FailureKind::EXCEPTION, 0, ErrorKind::TIMEOUT),
                                   Evidence::kVictimClaim},
                      EvidenceCase{"a peer failure thrown by a collective is a victim's claim",
                                   ev(FailureKind::EXCEPTION, 0, ErrorKind::PEER_FAILURE),
                                   Evidence::kVictimClaim},
                      EvidenceCase{"a foreign exception is the process's own",
                                   ev(FailureKind::EXCEPTION, 0, ErrorKind::C10), Evidence::kOwn},
                      EvidenceCase{"a failure reported without an error kind is the process's own",
                                   ev(FailureKind::EXCEPTION, 0, ErrorKind::NONE), Evidence::kOwn},
                      EvidenceCase{"being torn down is a consequence",
                                   ev(FailureKind::TORN_DOWN, 0), Evidence::kTeardown}),
    case_name<EvidenceCase>);

// A report (Failure message or failure dump) as an event: diverged in the rank's words, anything
// else an exception after its error kind's name (the report's when it names none), a victim's
// claim kept as one; the evidence is when it was met, or now when that is unknown or later.
TEST(FailurePolicy, AReportedFailureIsItsKindInItsWords) {
  const Event d = reported_failure(megacpp::schema::FailureReport::EXCEPTION, ErrorKind::DIVERGED,
                                   "step 7: loss nan", 100, 200, Phase::OPTIMIZER, 7);
  EXPECT_EQ(d.kind, FailureKind::DIVERGED);
  EXPECT_EQ(d.message, "step 7: loss nan");
  EXPECT_EQ(d.evidence_ns, 100);
  EXPECT_EQ(d.detected_ns, 200);
  EXPECT_EQ(d.step, 7u);
  EXPECT_EQ(evidence_of(d), Evidence::kOwn);
  const Event v =
      reported_failure(megacpp::schema::FailureReport::EXCEPTION, ErrorKind::PEER_FAILURE,
                       "rank 1 left", 0, 200, Phase::OPTIMIZER, 7);
  EXPECT_EQ(v.kind, FailureKind::EXCEPTION);
  EXPECT_EQ(v.message, "peer_failure: rank 1 left");
  EXPECT_EQ(v.evidence_ns, 200);
  EXPECT_EQ(evidence_of(v), Evidence::kVictimClaim);
  const Event n = reported_failure(megacpp::schema::FailureReport::EXCEPTION, ErrorKind::NONE,
                                   "what()", 300, 200, Phase::FORWARD, 2);
  EXPECT_EQ(n.message, "exception: what()");
  EXPECT_EQ(n.evidence_ns, 200);
}

TEST(FailurePolicy, MoreTellingThenEarlier) {
  // Same class: the earlier evidence wins.
  EXPECT_TRUE(more_telling(ev(FailureKind::EXITED, 1), ev(FailureKind::SIGNALED, 2)));
  EXPECT_FALSE(more_telling(ev(FailureKind::EXITED, 2), ev(FailureKind::SIGNALED, 1)));
  // Class before time.
  EXPECT_TRUE(more_telling(ev(FailureKind::EXITED, 9), ev(FailureKind::HUNG, 1)));
  EXPECT_TRUE(
      more_telling(ev(FailureKind::HUNG, 9), ev(FailureKind::EXCEPTION, 1, ErrorKind::TIMEOUT)));
}

TEST(FailurePolicy, EventsAfterTheTeardownBeganAreItsConsequences) {
  const int64_t teardown = 10 * kS;
  EXPECT_TRUE(admitted(ev(FailureKind::EXITED, 3), 0)) << "no teardown yet: everything counts";
  EXPECT_TRUE(admitted(ev(FailureKind::EXCEPTION, 9.5), teardown))
      << "a process's own report of something it met before the SIGTERM counts";
  EXPECT_FALSE(admitted(ev(FailureKind::SIGNALED, 10), teardown));
  EXPECT_FALSE(admitted(ev(FailureKind::EXITED, 11), teardown));
  EXPECT_TRUE(admitted(ev(FailureKind::DIVERGED, 11), teardown))
      << "a rank's own non-finite numbers are never a consequence of the teardown";
}

// ---------------------------------------------------------------------------------------
// Restartable stages and restarts.

struct RestartCase {
  const char* rule;
  StageKind stage;
  uint32_t restarts;
  bool failure_detected;
  bool done;
  Restart want;
};
void PrintTo(const RestartCase& c, std::ostream* os) {
  *os << c.rule;
}

class Restart_ : public ::testing::TestWithParam<RestartCase> {};

TEST_P(Restart_, Decides) {
  const RestartCase& c = GetParam();
  EXPECT_EQ(decide_restart(c.stage, c.restarts, 3, c.failure_detected, c.done), c.want) << c.rule;
}

INSTANTIATE_TEST_SUITE_P(
    FailurePolicy, Restart_,
    ::testing::Values(RestartCase{"a failed collector is restarted", StageKind::COLLECTOR, 0, false,
                                  false, Restart::kRestart},
                      RestartCase{"a failed data loader is restarted", StageKind::DATA_LOADER, 2,
                                  false, false, Restart::kRestart},
                      RestartCase{"a failed checkpointer is restarted", StageKind::CHECKPOINTER, 0,
                                  false, false, Restart::kRestart},
                      RestartCase{"a trainer rank is never restarted", StageKind::TRAINER, 0, false,
                                  false, Restart::kFail},
                      RestartCase{"the restart budget spent, the run fails naming the restarts",
                                  StageKind::COLLECTOR, 3, false, false, Restart::kExhausted},
                      RestartCase{
                          "no restart once a failure was detected (the run is being torn down)",
                          StageKind::DATA_LOADER, 0, true, false, Restart::kFail},
                      RestartCase{"no restart while the run is finishing", StageKind::CHECKPOINTER,
                                  0, false, true, Restart::kFail}),
    case_name<RestartCase>);

TEST(FailurePolicy, RestartableStages) {
  EXPECT_TRUE(restartable(StageKind::COLLECTOR));
  EXPECT_TRUE(restartable(StageKind::DATA_LOADER));
  EXPECT_TRUE(restartable(StageKind::CHECKPOINTER));
  EXPECT_FALSE(restartable(StageKind::TRAINER));
  EXPECT_FALSE(restartable(StageKind::SUPERVISOR));
}

TEST(FailurePolicy, ARestartedStagesOldGenerationIsIgnored) {
  EXPECT_TRUE(heartbeat_counts(2, 2));
  EXPECT_FALSE(heartbeat_counts(1, 2)) << "a heartbeat queued by the killed generation";
}

TEST(FailurePolicy, AGenerationKilledForARestartMustBeReapedWithinItsBound) {
  EXPECT_FALSE(restart_reap_overdue(kRestartReapBoundSeconds));
  EXPECT_TRUE(restart_reap_overdue(kRestartReapBoundSeconds + 0.1));
}

// ---------------------------------------------------------------------------------------
// Budgets.

TEST(FailurePolicy, PhaseBudgets) {
  const Budgets b = budgets();
  const std::vector<double> steps = {0.1, 0.2, 3.0};  // median 0.2
  EXPECT_EQ(phase_budget(b, StageKind::TRAINER, 0, Phase::FORWARD, steps), b.startup_s)
      << "a trainer before its first step has the start-up budget";
  EXPECT_EQ(phase_budget(b, StageKind::TRAINER, 5, Phase::STARTUP, steps), b.startup_s);
  EXPECT_EQ(phase_budget(b, StageKind::DATA_LOADER, 5, Phase::PRODUCE, steps), b.startup_s)
      << "stages other than trainers are judged by their own progress, not a phase budget";
  EXPECT_EQ(phase_budget(b, StageKind::TRAINER, 5, Phase::FORWARD, steps), b.hang_s)
      << "fast steps: the hang budget's floor";
  const std::vector<double> slow = {2.0, 2.5, 3.0};  // median 2.5 -> 20 x 2.5 = 50 s
  EXPECT_EQ(phase_budget(b, StageKind::TRAINER, 5, Phase::FORWARD, slow), 50.0)
      << "slow steps: a multiple of the median step";
  EXPECT_EQ(phase_budget(b, StageKind::TRAINER, 5, Phase::FORWARD, {}), b.hang_s);
}

TEST(FailurePolicy, StallBudgetsPerRestartableStage) {
  const Budgets b = budgets();
  EXPECT_EQ(stall_budget(b, StageKind::COLLECTOR), 30.0);
  EXPECT_EQ(stall_budget(b, StageKind::DATA_LOADER), 30.0);
  EXPECT_EQ(stall_budget(b, StageKind::CHECKPOINTER), 60.0);
}

TEST(FailurePolicy, SilenceLimit) {
  const Budgets b = budgets();
  EXPECT_EQ(silence_limit(b, false, 30), b.startup_s) << "before its hello a process is starting";
  EXPECT_EQ(silence_limit(b, true, 30), b.heartbeat_timeout_s);
  EXPECT_EQ(silence_limit(b, true, 4), 4.0) << "a phase budget shorter than the timeout wins";
}

TEST(FailurePolicy, ARankWaitingOnAStageIsJudgedAfterThatStagesOwnBudget) {
  const Budgets b = budgets();
  EXPECT_EQ(waited_on(Phase::WAIT_BATCH), StageKind::DATA_LOADER);
  EXPECT_EQ(waited_on(Phase::SNAPSHOT), StageKind::CHECKPOINTER);
  EXPECT_EQ(waited_on(Phase::FORWARD), std::nullopt);
  // Not waiting on anyone: the later of phase start and last progress, its own budget.
  RankClock own = rank_clock(b, 5 * kS, 7 * kS, 30, std::nullopt, 0);
  EXPECT_EQ(own.since_ns, 7 * kS);
  EXPECT_EQ(own.budget_s, 30.0);
  // Waiting on a checkpointer relaunched at t=20 s: the clock starts at its launch; the budget
  // covers its stall budget and a heartbeat timeout.
  RankClock dep = rank_clock(b, 5 * kS, 7 * kS, 30, StageKind::CHECKPOINTER, 20 * kS);
  EXPECT_EQ(dep.since_ns, 20 * kS);
  EXPECT_EQ(dep.budget_s, 70.0);
}

TEST(FailurePolicy, AStarvedRankOnAnEmptyRingBlamesTheLoader) {
  const Budgets b = budgets();
  EXPECT_TRUE(loader_starves_rank(b, Phase::WAIT_BATCH, 0, 11, true));
  EXPECT_FALSE(loader_starves_rank(b, Phase::WAIT_BATCH, 0, 9, true))
      << "within a heartbeat timeout";
  EXPECT_FALSE(loader_starves_rank(b, Phase::WAIT_BATCH, 1, 11, true)) << "the ring has a batch";
  EXPECT_FALSE(loader_starves_rank(b, Phase::FORWARD, 0, 11, true)) << "not waiting for a batch";
  EXPECT_FALSE(loader_starves_rank(b, Phase::WAIT_BATCH, 0, 11, false))
      << "a dead loader is handled by its own death";
}

// ---------------------------------------------------------------------------------------
// The hang sweep and the teardown.

struct SweepCase {
  const char* rule;
  bool failure_detected, alive, said_hello, stop_sent, has_event;
  double silent_s;
  bool swept;
};
void PrintTo(const SweepCase& c, std::ostream* os) {
  *os << c.rule;
}

class Sweep_ : public ::testing::TestWithParam<SweepCase> {};

TEST_P(Sweep_, RecordsSilentPeers) {
  const SweepCase& c = GetParam();
  EXPECT_EQ(swept_as_silent(budgets(), c.failure_detected, c.alive, c.said_hello, c.stop_sent,
                            c.has_event, c.silent_s),
            c.swept)
      << c.rule;
}

INSTANTIATE_TEST_SUITE_P(
    FailurePolicy, Sweep_,
    ::testing::Values(
        SweepCase{"after a detection, a peer silent for three heartbeat intervals is recorded",
                  true, true, true, false, false, 0.7, true},
        SweepCase{"not before any failure was detected", false, true, true, false, false, 0.7,
                  false},
        SweepCase{"not within three heartbeat intervals", true, true, true, false, false, 0.5,
                  false},
        SweepCase{"not a process that already has an event", true, true, true, false, true, 5,
                  false},
        SweepCase{"not a process asked to stop", true, true, true, true, false, 5, false},
        SweepCase{"not a process that never said hello (still starting)", true, true, false, false,
                  false, 5, false},
        SweepCase{"not a dead process (its death is its event)", true, false, true, false, false, 5,
                  false}),
    case_name<SweepCase>);

TEST(FailurePolicy, TeardownSignal) {
  EXPECT_EQ(teardown_signal(false, 'S'), SIGTERM) << "a live process gets its grace period";
  EXPECT_EQ(teardown_signal(true, 'S'), SIGKILL) << "a silent process cannot act on SIGTERM";
  EXPECT_EQ(teardown_signal(false, 'T'), SIGKILL) << "neither can a stopped one";
}
