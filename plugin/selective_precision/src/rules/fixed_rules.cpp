// Modes off and static (policy v1): no data decides. Off moves every block as BF16; static
// moves the force lists' blocks at their precision and every other block as BF16.
#include "sp/policy/decision_rule.h"
#include "sp/policy/engine.h"

namespace sp::policy {
namespace {

class FixedRule final : public DecisionRule {
 public:
  FixedRule(PolicyEngine &engine, bool honours_force_lists) : engine_(engine), honours_force_lists_(honours_force_lists) {}

  bool decide(std::int64_t step, bool decision_step) override {
    (void)step;
    const PolicyState &state = engine_.rule_state();
    for (sp_hint_v1 &hint : engine_.hints()) {
      const std::int8_t forced = honours_force_lists_ ? engine_.forced(hint.block_id) : -1;
      hint.precision = forced >= 0 ? forced : SP_PRECISION_BF16;
      hint.reason = forced >= 0 ? SP_REASON_FORCED : SP_REASON_MODE;
      hint.sensitivity = state.blocks[hint.block_id].score.sensitivity;
    }
    return decision_step;
  }

 private:
  PolicyEngine &engine_;
  bool honours_force_lists_;
};

}  // namespace

extern const RuleModule kOffRule{Mode::off, "off", 1, false, false, {},
                                 [](PolicyEngine &engine) -> std::unique_ptr<DecisionRule> {
                                   return std::make_unique<FixedRule>(engine, false);
                                 }};
extern const RuleModule kStaticRule{Mode::static_lists, "static", 1, false, false, {},
                                    [](PolicyEngine &engine) -> std::unique_ptr<DecisionRule> {
                                      return std::make_unique<FixedRule>(engine, true);
                                    }};

}  // namespace sp::policy
