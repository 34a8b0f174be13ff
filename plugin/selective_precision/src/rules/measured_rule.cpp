// Mode measured (policy v4): the host measures what each unit costs at each tier, forward only,
// against BF16 (the KL of the outputs, or the loss difference, per example), and sends the mean,
// its standard error and its upper confidence bound (measured_cost.<tier>,
// measured_cost_se.<tier>, measured_cost_upper.<tier>). The rule solves the bytes budget on the
// upper bounds, so that a noisy low draw cannot make a tier look free, and a unit leaves its
// tier only for a gain of more than switch_sigmas standard errors. Before any measurement the
// structural prior (use_more_bits) decides, from the first step's routes on. A table is a
// measurement of its own, not smoothed with the last: the host's interval already covers all its
// batches. A re-solve for another reason (new sizes, a standing rule moved a unit) uses the costs
// of the last adopted measurement, so nothing measured after decide_until_step moves a unit.
// Then the swaps at the knapsack's boundary (ABI 1.4): the boundary_swaps units cheapest to
// narrow and the boundary_swaps units that gain most from widening, paired at no more bytes, are
// proposed for the host to measure jointly with the allocation; one is taken only when its paired
// difference from the allocation is below zero beyond its confidence interval, the lowest such.
// A taken swap holds while the knapsack still answers with the allocation it was measured
// against (or with the swap itself): new sizes, a new budget or a moved unit drop it.
// Once training began, the boundary is measured again only when some unit's gradients drifted
// beyond their noise since the measurement (DriftWatch): the cheap per-step signal asks, the
// measurement decides. docs/policy.md, "Policy v4".
#include "budgeted_rule.h"
#include "../byte_codec.h"
#include "../json_values.h"
#include "sp/policy/routes.h"

#include <algorithm>
#include <cstdlib>
#include <array>
#include <cmath>
#include <limits>
#include <optional>

namespace sp::policy {
namespace {

constexpr const char *kSwitchSigmas = "switch_sigmas";
constexpr const char *kDecideUntilStep = "decide_until_step";
constexpr const char *kBoundarySwaps = "boundary_swaps";
constexpr const char *kDriftSigmas = "drift_sigmas";
constexpr const char *kDriftWindow = "drift_window";
constexpr std::uint32_t kSectionTag = 0x4452534D;  // "MSRD" as the codec writes tags

// One unit's measurement at one tier.
struct Measured {
  double mean = ScoreParts::kNever;
  double se = ScoreParts::kNever;
  double upper = ScoreParts::kNever;
};
using MeasuredTiers = PerTier<Measured>;

constexpr std::size_t kFixedSize = 8 + 8 + 8 + 1 + 1;
// Per unit: the last measurement, then the adopted one, each a mean, se and upper bound per tier.
constexpr std::size_t kUnitSize = 2 * kTiers.size() * 3 * 8;
// Appended only while a measured choice stands: whether the next decision has yet to take it, then
// per unit its tier and the tier of the allocation it was measured against. A section without it
// reads as no choice, as one written before the boundary swaps does.
constexpr std::size_t kChoiceFixedSize = 1;

// One unit's move by one tier: what it changes in cost (upper bounds) and in bytes.
struct Move {
  std::uint32_t unit;
  sp_precision to;
  double cost_change;
  std::int64_t byte_change;
};
// A cost, its spread or its bound beyond this magnitude is refused: the knapsack sums them.
constexpr double kLargestValue = 1e12;

// Whether some unit's gradients moved beyond their noise since the allocation's measurement: per
// unit, the log of its mean squared gradient element (a step's post_backward moments), the
// first `window` samples after a restart its reference, then each next `window` samples tested
// against it (Welch's z: the difference of the means over its standard error). Windows do not
// overlap, so a unit is tested once per `window` steps. The mean square is a cheap stand-in for
// the diagonal of the Fisher information that weighs the unit's quantization noise.
// A drift asks for a measurement; it decides nothing.
class DriftWatch {
 public:
  DriftWatch(std::uint32_t units, double sigmas, std::uint32_t window)
      : sigmas_(sigmas), window_(window), reference_(units), recent_(units), evidence_(units, ScoreParts::kNever) {}

  // From the next sample on, each unit's reference is taken anew.
  void restart() {
    std::fill(reference_.begin(), reference_.end(), Moments{});
    std::fill(recent_.begin(), recent_.end(), Moments{});
    std::fill(evidence_.begin(), evidence_.end(), ScoreParts::kNever);
    wanted_ = false;
  }

  void take(std::int64_t step, const sp_grad_moments_v1 &m) {
    // sigmas 0: no watch. Once a measurement is wanted, the watch waits for it, but the units of
    // the step that asked are all tested, so that the strongest evidence is known. A gradient of
    // zeros has no log; it neither sets nor tests a reference.
    if (sigmas_ == 0.0 || (wanted_ && step != wanted_at_step_) || !(m.sum_sq > 0.0)) return;
    const double x = std::log(m.sum_sq / static_cast<double>(m.count));
    Moments &reference = reference_[m.block_id];
    if (reference.n < window_) {
      reference.add(x);
      return;
    }
    Moments &recent = recent_[m.block_id];
    recent.add(x);
    if (recent.n < window_) return;
    evidence_[m.block_id] = welch_z(reference, recent);
    recent = Moments{};
    if (evidence_[m.block_id] > sigmas_ && !wanted_) {
      wanted_ = true;
      wanted_at_step_ = step;
      ++requests_;
    }
  }

  bool wanted() const { return wanted_; }

  // The units whose last test exceeded sigmas, the strongest evidence first, at most `limit`.
  std::vector<std::uint32_t> drifted(std::size_t limit) const {
    std::vector<std::uint32_t> units;
    for (std::uint32_t u = 0; u < evidence_.size(); ++u) {
      if (evidence_[u] > sigmas_) units.push_back(u);
    }
    std::stable_sort(units.begin(), units.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return evidence_[a] > evidence_[b]; });
    if (units.size() > limit) units.resize(limit);
    return units;
  }

  void describe(nlohmann::ordered_json &out) const {
    out = {{"sigmas", sigmas_},
           {"window", window_},
           {"wanted", wanted_},
           {"requests", requests_},
           {"last_request_step", requests_ > 0 ? nlohmann::ordered_json(wanted_at_step_) : nullptr}};
  }
  double evidence(std::uint32_t unit) const { return evidence_[unit]; }

 private:
  // Welford's running mean and sum of squared deviations.
  struct Moments {
    std::uint32_t n = 0;
    double mean = 0.0;
    double m2 = 0.0;
    void add(double x) {
      ++n;
      const double delta = x - mean;
      mean += delta / n;
      m2 += delta * (x - mean);
    }
    double variance_of_mean() const { return n > 1 ? m2 / (n - 1) / n : 0.0; }
  };

  // A change of the log mean square below this is no drift, however steady the gradients: the
  // floor of the z's denominator (identical steps have a spread of zero).
  static constexpr double kLogResolution = 1e-6;

  static double welch_z(const Moments &reference, const Moments &recent) {
    const double se = std::sqrt(reference.variance_of_mean() + recent.variance_of_mean());
    return std::fabs(recent.mean - reference.mean) / std::max(se, kLogResolution);
  }

  double sigmas_;
  std::uint32_t window_;
  std::vector<Moments> reference_;
  std::vector<Moments> recent_;
  std::vector<double> evidence_;  // per unit, its last test's z; NaN before one
  bool wanted_ = false;
  std::int64_t wanted_at_step_ = 0;
  std::uint64_t requests_ = 0;
};

class MeasuredRule final : public BudgetedRule {
 public:
  explicit MeasuredRule(PolicyEngine &engine)
      : BudgetedRule(engine),
        switch_sigmas_(rule_setting(engine.config(), Mode::measured, kSwitchSigmas)),
        decide_until_step_(static_cast<std::int64_t>(rule_setting(engine.config(), Mode::measured, kDecideUntilStep))),
        boundary_swaps_(static_cast<std::uint32_t>(rule_setting(engine.config(), Mode::measured, kBoundarySwaps))),
        drift_(engine.n_blocks(), rule_setting(engine.config(), Mode::measured, kDriftSigmas),
               static_cast<std::uint32_t>(rule_setting(engine.config(), Mode::measured, kDriftWindow))),
        units_(engine.n_blocks()),
        decided_(engine.n_blocks()) {}

  // A table without an upper bound for any tier is not a measurement this rule reads.
  void take_signals(std::int64_t step, const SignalTable &table) override {
    std::array<std::int64_t, kTiers.size()> mean{}, se{}, upper{};
    bool any = false;
    for (std::size_t t = 0; t < kTiers.size(); ++t) {
      mean[t] = table.column(mean_columns_(kTiers[t]));
      se[t] = table.column(se_columns_(kTiers[t]));
      upper[t] = table.column(upper_columns_(kTiers[t]));
      any = any || upper[t] >= 0;
    }
    if (!any) return;
    std::vector<MeasuredTiers> units(units_.size());
    for (std::uint32_t u = 0; u < engine_.n_blocks(); ++u) {
      for (std::size_t t = 0; t < kTiers.size(); ++t) {
        Measured &m = units[u].values[t];
        m = Measured{table.value(u, mean[t]), table.value(u, se[t]), table.value(u, upper[t])};
        // An interval that does not hold its own mean, or a negative spread, is not a measurement.
        if (!plausible(m)) {
          throw InvalidArgument(fmt::format("set_unit_signals: unit {} has {} = {}, {} = {} and {} = {}; expected an "
                                            "upper bound >= the mean, a standard error >= 0, each of magnitude at "
                                            "most {} (or NaN)",
                                            u, mean_columns_(kTiers[t]), m.mean, upper_columns_(kTiers[t]), m.upper, se_columns_(kTiers[t]),
                                            m.se, kLargestValue));
        }
      }
    }
    units_ = std::move(units);
    ++tables_;
    last_step_ = step;
    samples_ = table.samples();
    pending_ = true;
  }

  bool decides_initial_hints() const override { return true; }

  void take_moments(std::int64_t step, const sp_grad_moments_v1 &moments) override {
    // Only an allocation a measurement made can have drifted from it, and a measurement at or
    // after decide_until_step would move nothing.
    if (!adopted_ || engine_.state().budget.source != AllocationSource::measured) return;
    if (decide_until_step_ >= 0 && step >= decide_until_step_) return;
    drift_.take(step, moments);
  }

  // The swaps at the boundary of the allocation in force, once it is a measured one: before the
  // first step, and from then on only when the gradients drifted.
  std::vector<std::vector<sp_precision>> alternatives() const override {
    // Not while newer unit costs wait to be adopted: the allocation they give is not yet in force.
    if (boundary_swaps_ == 0 || !adopted_ || pending_ || engine_.state().budget.source != AllocationSource::measured) {
      return {};
    }
    // A measurement acts at the next step's decision at the earliest: none is asked for that no
    // decision could take.
    const PolicyState &state = engine_.state();
    const std::int64_t step = state.current_step;
    if (step >= 0 && (!drift_.wanted() || (decide_until_step_ >= 0 && step >= decide_until_step_))) return {};
    const std::uint32_t n = engine_.n_blocks();
    std::vector<sp_precision> current(n);
    for (std::uint32_t u = 0; u < n; ++u) current[u] = travels_as(state.blocks[u].assignment);
    // The step whose decision a swap would take effect at; before the first step nothing pins a unit
    // but a force list.
    const std::int64_t next = state.current_step + 1;
    const auto pinned = [&](std::uint32_t u) {
      if (engine_.forced(u) >= 0) return true;
      const BlockState &block = state.blocks[u];
      return state.current_step >= 0 && (!engine_.cooldown_passed(block, next) || engine_.under_penalty(block, next));
    };
    std::vector<Move> narrower, wider;
    for (std::uint32_t u = 0; u < n; ++u) {
      if (pinned(u)) continue;
      if (const std::optional<Move> move = adjacent_move(u, current[u], +1)) narrower.push_back(*move);
      if (const std::optional<Move> move = adjacent_move(u, current[u], -1)) wider.push_back(*move);
    }
    // Nearest the cut: the least cost added per byte saved, the most cost saved per byte added.
    const auto per_byte = [](const Move &m) { return m.cost_change / static_cast<double>(std::llabs(m.byte_change)); };
    const auto nearest = [&](std::vector<Move> &moves) {
      std::stable_sort(moves.begin(), moves.end(), [&](const Move &a, const Move &b) { return per_byte(a) < per_byte(b); });
      if (moves.size() > boundary_swaps_) moves.resize(boundary_swaps_);
    };
    nearest(narrower);
    nearest(wider);
    // The units that drifted most are measured moving too, wherever they stand from the cut: their
    // measured costs are the ones in doubt.
    for (const std::uint32_t u : drift_.drifted(boundary_swaps_)) {
      if (pinned(u)) continue;
      const auto absent = [u](const std::vector<Move> &moves) {
        return std::none_of(moves.begin(), moves.end(), [u](const Move &m) { return m.unit == u; });
      };
      if (const std::optional<Move> move = adjacent_move(u, current[u], +1); move && absent(narrower)) {
        narrower.push_back(*move);
      }
      if (const std::optional<Move> move = adjacent_move(u, current[u], -1); move && absent(wider)) {
        wider.push_back(*move);
      }
    }
    std::vector<std::vector<sp_precision>> out;
    for (const Move &up : wider) {
      for (const Move &down : narrower) {
        if (up.unit == down.unit || up.byte_change + down.byte_change > 0) continue;
        std::vector<sp_precision> swapped = current;
        swapped[up.unit] = up.to;
        swapped[down.unit] = down.to;
        out.push_back(std::move(swapped));
      }
    }
    return out;
  }

  void take_allocation_measurements(std::int64_t step, const AllocationMeasurements &measured) override {
    // The measurement answers a drift: the watch takes its reference again from the next step.
    drift_.restart();
    // Never one at or after decide_until_step: nothing is proposed then (alternatives()), and a
    // step closes every proposal.
    last_swaps_ = LastSwaps{step, static_cast<std::uint32_t>(measured.rows.size() - 1), 0, ScoreParts::kNever,
                            ScoreParts::kNever};
    // A choice not yet taken was of the allocation this measurement found in force, and is superseded.
    if (choice_pending_) clear_choice();
    const std::uint64_t in_force = bytes_of(measured.rows[0].routes);
    for (std::uint32_t k = 1; k < measured.rows.size(); ++k) {
      const MeasuredAllocation &row = measured.rows[k];
      // Better beyond its interval, at no more bytes: a draw within the noise never moves a unit.
      if (!(row.difference_upper < 0.0) || bytes_of(row.routes) > in_force) continue;
      if (last_swaps_->chosen == 0 || row.difference < last_swaps_->difference) {
        last_swaps_->chosen = k;
        last_swaps_->difference = row.difference;
        last_swaps_->difference_upper = row.difference_upper;
      }
    }
    if (last_swaps_->chosen == 0) return;
    // Measured around a choice that stands (a re-measurement on drift), the new choice still
    // stands against the knapsack's answer the first one was measured against.
    const bool around_standing_choice = !choice_.empty() && !choice_pending_ && measured.rows[0].routes == choice_;
    if (!around_standing_choice) choice_base_ = measured.rows[0].routes;
    choice_ = measured.rows[last_swaps_->chosen].routes;
    choice_pending_ = true;
  }

  std::optional<double> own_cost(std::uint32_t unit, sp_precision precision) const override {
    return adopted_ ? decided_[unit][precision].upper : ScoreParts::kNever;
  }
  bool cost_is_loss() const override { return false; }

  std::uint32_t state_tag() const override { return kSectionTag; }

  std::vector<std::uint8_t> export_section() const override {
    Writer out;
    out.u64(tables_);
    out.i64(last_step_);
    out.u64(samples_);
    out.u8(pending_ ? 1 : 0);
    out.u8(adopted_ ? 1 : 0);
    for (const std::vector<MeasuredTiers> *units : {&units_, &decided_}) {
      for (const MeasuredTiers &unit : *units) {
        for (const Measured &m : unit) {
          out.f64(m.mean);
          out.f64(m.se);
          out.f64(m.upper);
        }
      }
    }
    if (!choice_.empty()) {
      out.u8(choice_pending_ ? 1 : 0);
      for (std::size_t u = 0; u < choice_.size(); ++u) {
        out.u8(static_cast<std::uint8_t>(choice_[u]));
        out.u8(static_cast<std::uint8_t>(choice_base_[u]));
      }
    }
    return out.take();
  }

  void import_section(const std::vector<std::uint8_t> *payload) override {
    if (payload == nullptr) {
      // The watch's windows are not part of the state: it takes its reference from the next step.
      drift_.restart();
      units_.assign(units_.size(), MeasuredTiers{});
      decided_.assign(decided_.size(), MeasuredTiers{});
      tables_ = 0;
      last_step_ = kNoStep;
      samples_ = 0;
      pending_ = false;
      adopted_ = false;
      clear_choice();
      return;
    }
    const std::size_t size = payload->size();
    const std::size_t costs_size = kFixedSize + kUnitSize * units_.size();
    const std::size_t with_choice = costs_size + kChoiceFixedSize + 2 * units_.size();
    if (size != costs_size && size != with_choice) {
      throw StateError(fmt::format("state blob: the measured-costs section is {} bytes, expected {} or {} (with a "
                                   "measured choice) for {} units",
                                   size, costs_size, with_choice, units_.size()));
    }
    Reader reader(payload->data(), size);
    const std::uint64_t tables = reader.u64("measured tables");
    const std::int64_t last_step = reader.i64("last measured step");
    const std::uint64_t samples = reader.u64("samples of the last measurement");
    const bool pending = reader.flag("measurement-pending flag");
    const bool adopted = reader.flag("measurement-adopted flag");
    if ((tables == 0) != (last_step == kNoStep) || (tables == 0 && (pending || adopted)) ||
        (tables > 0 && last_step < -1)) {
      throw StateError(fmt::format("state blob: {} measured tables do not fit last step {}, pending {} and adopted {}",
                                   tables, last_step, pending, adopted));
    }
    std::vector<MeasuredTiers> units(units_.size());
    std::vector<MeasuredTiers> decided(units_.size());
    for (std::vector<MeasuredTiers> *read : {&units, &decided}) {
      for (std::size_t u = 0; u < read->size(); ++u) {
        for (Measured &m : (*read)[u]) {
          m.mean = reader.f64("measured cost");
          m.se = reader.f64("measured standard error");
          m.upper = reader.f64("measured upper bound");
          if (!plausible(m)) {
            throw StateError(fmt::format("state blob: unit {} has a measured cost {} with standard error {} and upper "
                                         "bound {}; expected upper >= mean, se >= 0, each of magnitude at most {} "
                                         "or NaN",
                                         u, m.mean, m.se, m.upper, kLargestValue));
          }
        }
      }
    }
    std::vector<sp_precision> choice, choice_base;
    bool choice_pending = false;
    if (size == with_choice) {
      if (!adopted) throw StateError("state blob: a measured choice stands on a measurement that was never adopted");
      choice_pending = reader.flag("measured-choice-pending flag");
      for (std::size_t u = 0; u < units_.size(); ++u) {
        for (std::vector<sp_precision> *into : {&choice, &choice_base}) {
          const std::uint8_t tier = reader.u8("measured choice's tier");
          if (!tier_position(static_cast<sp_precision>(tier))) {
            throw StateError(fmt::format("state blob: the measured choice gives unit {} precision {}; expected {}", u,
                                         tier, route_codes_text()));
          }
          into->push_back(static_cast<sp_precision>(tier));
        }
      }
    }
    tables_ = tables;
    last_step_ = last_step;
    samples_ = samples;
    pending_ = pending;
    adopted_ = adopted;
    units_ = std::move(units);
    decided_ = std::move(decided);
    choice_ = std::move(choice);
    choice_base_ = std::move(choice_base);
    choice_pending_ = choice_pending;
    drift_.restart();
  }

  void describe(nlohmann::ordered_json &record) const override {
    record["measured"] = {
        {"tables", tables_},
        {"last_step", tables_ > 0 ? nlohmann::ordered_json(last_step_) : nullptr},
        {"samples", samples_},
        {"pending", pending_},
        {"adopted", adopted_},
        {"switch_sigmas", switch_sigmas_},
        {"decide_until_step", decide_until_step_ >= 0 ? nlohmann::ordered_json(decide_until_step_) : nullptr},
        {"boundary_swaps", boundary_swaps_},
        {"measured_choice", !choice_.empty()},
    };
    drift_.describe(record["measured"]["drift"]);
    if (last_swaps_) {
      record["measured"]["last_swaps"] = {
          {"step", last_swaps_->step},
          {"alternatives", last_swaps_->alternatives},
          {"chosen", last_swaps_->chosen},
          {"difference", number_or_null(last_swaps_->difference)},
          {"difference_upper", number_or_null(last_swaps_->difference_upper)},
      };
    }
  }

  void describe_unit(std::uint32_t unit, nlohmann::ordered_json &detail) const override {
    nlohmann::ordered_json tiers = nlohmann::ordered_json::object();
    for (std::size_t t = 1; t < kTiers.size(); ++t) {
      const Measured &m = units_[unit].values[t];
      tiers[precision_name(kTiers[t])] = {
          {"mean", number_or_null(m.mean)}, {"se", number_or_null(m.se)}, {"upper", number_or_null(m.upper)}};
    }
    detail["measured_cost"] = std::move(tiers);
    detail["drift_evidence"] = number_or_null(drift_.evidence(unit));
  }

 protected:
  bool has_costs() const override { return adopted_; }

  // BF16 is the reference the costs are measured against: it costs nothing.
  double cost(std::uint32_t unit, sp_precision tier) const override {
    return tier == SP_PRECISION_BF16 ? 0.0 : decided_[unit][tier].upper;
  }

  // Hysteresis in standard errors, once the allocation is a measured one: the first measurement
  // replaces the prior freely.
  double switch_penalty(std::uint32_t unit, sp_precision tier) const override {
    if (engine_.state().budget.source != AllocationSource::measured) return 0.0;
    const double se = decided_[unit][tier].se;
    return std::isnan(se) ? 0.0 : switch_sigmas_ * se;
  }

  // No decision after decide_until_step: the last steps train on the routes they began with.
  bool costs_call_for_allocation(std::int64_t step, bool /*decision_step*/) const override {
    return (pending_ || choice_pending_) && (decide_until_step_ < 0 || step <= decide_until_step_);
  }

  // A new measurement of the units supersedes a choice made on the last one.
  void adopt_new_costs() override {
    if (pending_) {
      decided_ = units_;
      adopted_ = true;
      pending_ = false;
      clear_choice();
      drift_.restart();
    }
    choice_pending_ = false;
  }
  // Only a choice the decision has taken (not one waiting past decide_until_step), and only while the
  // knapsack answers with the allocation it was measured against or with the choice itself.
  const std::vector<sp_precision> *measured_choice(const std::vector<sp_precision> &knapsack) const override {
    if (choice_.empty() || choice_pending_ || (knapsack != choice_base_ && knapsack != choice_)) return nullptr;
    return &choice_;
  }
  void drop_measured_choice() override { clear_choice(); }
  AllocationSource costs_source() const override { return AllocationSource::measured; }
  void costs_taken() override {}

 private:
  static constexpr std::int64_t kNoStep = std::numeric_limits<std::int64_t>::min();

  static bool plausible(const Measured &m) {
    const auto bounded = [](double v) { return std::isnan(v) || std::fabs(v) <= kLargestValue; };
    return bounded(m.mean) && bounded(m.se) && bounded(m.upper) && !(m.se < 0.0) &&
           (std::isnan(m.mean) || std::isnan(m.upper) || m.upper >= m.mean);
  }

  // Unit u moved to the next open tier narrower (direction +1) or wider (-1) than `from`: a
  // configured tier the measurement prices, as the knapsack opens them; nullopt where there is
  // none.
  std::optional<Move> adjacent_move(std::uint32_t u, sp_precision from, int direction) const {
    const PolicySettings &config = engine_.config();
    const double before = cost(u, from);
    if (std::isnan(before)) return std::nullopt;
    // kTiers runs from the widest tier to the narrowest.
    const auto at = static_cast<int>(std::find(kTiers.begin(), kTiers.end(), from) - kTiers.begin());
    for (int r = at + direction; r >= 0 && r < static_cast<int>(kTiers.size()); r += direction) {
      const sp_precision to = kTiers[static_cast<std::size_t>(r)];
      const double after = cost(u, to);
      if (!config.tier(to) || std::isnan(after)) continue;
      const BlockBytes &bytes = engine_.block_bytes()[u];
      const auto byte_change = static_cast<std::int64_t>(tier_bytes(bytes, to, config.nf4_group_size)) -
                               static_cast<std::int64_t>(tier_bytes(bytes, from, config.nf4_group_size));
      if (byte_change == 0) return std::nullopt;
      return Move{u, to, after - before, byte_change};
    }
    return std::nullopt;
  }

  void clear_choice() {
    choice_.clear();
    choice_base_.clear();
    choice_pending_ = false;
  }

  std::uint64_t bytes_of(const std::vector<sp_precision> &routes) const {
    return allocation_bytes(engine_.block_bytes(), routes, engine_.config().nf4_group_size);
  }

  // The last measurement of the swaps, for telemetry.
  struct LastSwaps {
    std::int64_t step;
    std::uint32_t alternatives;
    std::uint32_t chosen;  // 0: the allocation in force stayed
    double difference;
    double difference_upper;
  };

  double switch_sigmas_;
  std::int64_t decide_until_step_;
  std::uint32_t boundary_swaps_;
  DriftWatch drift_;
  const TierColumns mean_columns_{"measured_cost."};
  const TierColumns se_columns_{"measured_cost_se."};
  const TierColumns upper_columns_{"measured_cost_upper."};
  std::vector<MeasuredTiers> units_;    // the last measurement
  std::vector<MeasuredTiers> decided_;  // the one the allocation was made by
  bool adopted_ = false;
  std::uint64_t tables_ = 0;
  std::int64_t last_step_ = kNoStep;
  std::uint64_t samples_ = 0;
  bool pending_ = false;
  // The swap measured to beat the knapsack's allocation (a tier per unit), empty when none stands,
  // and whether the next decision has yet to take it.
  std::vector<sp_precision> choice_;
  std::vector<sp_precision> choice_base_;  // the allocation the choice was measured against
  bool choice_pending_ = false;
  std::optional<LastSwaps> last_swaps_;
};

}  // namespace

constexpr RuleKey kKeys[] = {
    {kSwitchSigmas, "a number in [0, 100]", 0.0, 100.0, 2.0, false, false},
    {kDecideUntilStep, "an integer >= -1 (-1: no last step)", -1.0, 9.0e15, -1.0, true, false},
    {kBoundarySwaps, "an integer in [0, 8] (0: no swaps measured)", 0.0, 8.0, 2.0, true, false},
    {kDriftSigmas, "a number in [0, 100] (0: the boundary is never measured again)", 0.0, 100.0, 4.0, false, false},
    {kDriftWindow, "an integer in [2, 10000]", 2.0, 10000.0, 8.0, true, false}};

extern const RuleModule kMeasuredRule{
    Mode::measured, "measured", 4, true, false, kKeys,
    [](PolicyEngine &engine) -> std::unique_ptr<DecisionRule> { return std::make_unique<MeasuredRule>(engine); }};

}  // namespace sp::policy
