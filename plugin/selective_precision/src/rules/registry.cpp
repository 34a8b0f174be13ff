// The decision rules this plugin knows, one line each (decision_rule.h). An edition has the
// modules whose first_edition it reaches.
#include "sp/policy/decision_rule.h"

#include <stdexcept>

namespace sp::policy {

extern const RuleModule kOffRule;
extern const RuleModule kStaticRule;
extern const RuleModule kThresholdRule;
extern const RuleModule kBudgetRule;
extern const RuleModule kMeasuredRule;

const RuleModules &rule_modules() {
  static const RuleModules of_edition = [] {
    RuleModules modules;
    for (const RuleModule *module : {&kOffRule, &kStaticRule, &kThresholdRule, &kBudgetRule, &kMeasuredRule}) {
      if (module->first_edition <= kPolicyEdition) modules.modules.at(modules.count++) = module;
    }
    return modules;
  }();
  return of_edition;
}

const RuleModule &rule_module(Mode mode) {
  for (const RuleModule *module : rule_modules()) {
    if (module->mode == mode) return *module;
  }
  throw std::logic_error("rule_module: a mode without a rule module in this edition");
}

}  // namespace sp::policy
