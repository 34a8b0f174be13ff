#include "sp/adapters/policy_bridge.h"

#include <stdexcept>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine_test_support.h"

namespace sp::adapters {
namespace {

using sp::adapters::testing::gate_of;
using ::testing::HasSubstr;

TEST(PolicyBridge, RoutesFollowThePluginUntilReplaced) {
  PolicyBridge bridge(3);
  EXPECT_EQ(bridge.route(1), Precision::bf16);
  const std::vector<Precision> hints = {Precision::bf16, Precision::int8, Precision::int8};
  bridge.set_plugin_routes(hints);
  bridge.begin_step();
  EXPECT_EQ(bridge.route(0), Precision::bf16);
  EXPECT_EQ(bridge.route(1), Precision::int8);
  bridge.clear_plugin_routes();
  EXPECT_EQ(bridge.route(1), Precision::bf16);
}

TEST(PolicyBridge, TransferGateKeepsBlocksBf16WhereInt8DoesNotPay) {
  PolicyBridge bridge(3);
  const std::vector<Precision> hints = {Precision::int8, Precision::int8, Precision::bf16};
  bridge.set_plugin_routes(hints);
  bridge.set_transfer_gate(gate_of({false, true, true}, {}));
  const RouteDecision vetoed = bridge.decide(0);
  EXPECT_EQ(vetoed.precision, Precision::bf16);
  EXPECT_EQ(vetoed.decided_by, RouteAuthority::transfer_policy);
  EXPECT_EQ(bridge.decide(1).precision, Precision::int8);
  EXPECT_EQ(bridge.decide(1).decided_by, RouteAuthority::plugin);
  // The gate only ever removes INT8: a block the plugin keeps BF16 stays BF16 by the plugin.
  EXPECT_EQ(bridge.decide(2).precision, Precision::bf16);
  EXPECT_EQ(bridge.decide(2).decided_by, RouteAuthority::plugin);
  // A runtime pin outranks both.
  RuntimeLimitHints pin;
  pin.block_precision_map[0] = Precision::int8;
  bridge.tighten(pin);
  EXPECT_EQ(bridge.decide(0).precision, Precision::int8);
  EXPECT_EQ(bridge.decide(0).decided_by, RouteAuthority::runtime_pin);
  bridge.begin_step();
  bridge.clear_transfer_gate();
  EXPECT_EQ(bridge.route(0), Precision::int8);
}

// What calibration relies on: under a gate where no quantized route pays, a pin still
// delivers the route it names, and once the pins are gone the hints and the gate route as
// before.
TEST(PolicyBridge, APinOverridesAGateUnderWhichNothingPays) {
  for (const TransferGate &nothing_pays : {TransferGate{}, gate_of({false, false, false}, {false, false, false})}) {
    PolicyBridge bridge(3);
    const std::vector<Precision> hints = {Precision::int8, Precision::nf4, Precision::bf16};
    bridge.set_plugin_routes(hints);
    bridge.set_transfer_gate(nothing_pays);
    for (std::uint32_t b = 0; b < 3; ++b) EXPECT_EQ(bridge.route(b), Precision::bf16) << "block " << b;
    for (const Precision pinned : {Precision::int8, Precision::nf4, Precision::bf16}) {
      bridge.begin_step();
      RuntimeLimitHints pins;
      for (std::uint32_t b = 0; b < 3; ++b) pins.block_precision_map[b] = pinned;
      bridge.tighten(pins);
      for (std::uint32_t b = 0; b < 3; ++b) {
        const RouteDecision decision = bridge.decide(b);
        EXPECT_EQ(decision.precision, pinned) << "block " << b;
        EXPECT_EQ(decision.requested, pinned) << "block " << b;
        EXPECT_EQ(decision.decided_by, RouteAuthority::runtime_pin) << "block " << b;
      }
    }
    bridge.begin_step();
    EXPECT_EQ(bridge.decide(0).precision, Precision::bf16);
    EXPECT_EQ(bridge.decide(0).decided_by, RouteAuthority::transfer_policy);
    EXPECT_EQ(bridge.decide(1).requested, Precision::nf4);
    bridge.clear_transfer_gate();
    EXPECT_EQ(bridge.route(0), Precision::int8);
    EXPECT_EQ(bridge.route(1), Precision::nf4);
    EXPECT_EQ(bridge.route(2), Precision::bf16);
  }
}

TEST(PolicyBridge, TransferGateOfTheWrongSizeIsRejected) {
  PolicyBridge bridge(3);
  try {
    bridge.set_transfer_gate(gate_of({true, false}, {}));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument &e) {
    EXPECT_THAT(e.what(),
                HasSubstr("the transfer gate has 2 entries in int8_pays; expected none or one per block (3)"));
  }
  EXPECT_FALSE(bridge.has_transfer_gate());
}

TEST(PolicyBridge, Nf4HintsRouteNf4WithoutAGate) {
  PolicyBridge bridge(3);
  const std::vector<Precision> hints = {Precision::nf4, Precision::int8, Precision::bf16};
  bridge.set_plugin_routes(hints);
  EXPECT_EQ(bridge.route(0), Precision::nf4);
  EXPECT_EQ(bridge.decide(0).decided_by, RouteAuthority::plugin);
  EXPECT_EQ(bridge.route(1), Precision::int8);
  EXPECT_EQ(bridge.route(2), Precision::bf16);
  EXPECT_STREQ(precision_name(Precision::nf4), "nf4");
}

// NF4 only where NF4 pays; where it does not, the next more precise route that pays (INT8,
// then BF16). INT8 never falls to NF4: that would be less precise than the plugin allowed.
TEST(PolicyBridge, TransferGateIsPerRouteAndNf4FallsBackToInt8ThenBf16) {
  PolicyBridge bridge(5);
  const std::vector<Precision> hints = {Precision::nf4, Precision::nf4, Precision::nf4, Precision::int8, Precision::bf16};
  bridge.set_plugin_routes(hints);
  bridge.set_transfer_gate(gate_of({true, true, false, false, true}, {true, false, false, true, true}));
  EXPECT_EQ(bridge.decide(0).precision, Precision::nf4);
  EXPECT_EQ(bridge.decide(0).decided_by, RouteAuthority::plugin);
  EXPECT_EQ(bridge.decide(1).precision, Precision::int8);
  EXPECT_EQ(bridge.decide(1).decided_by, RouteAuthority::transfer_policy);
  EXPECT_EQ(bridge.decide(1).requested, Precision::nf4);
  EXPECT_EQ(bridge.decide(2).precision, Precision::bf16);
  EXPECT_EQ(bridge.decide(2).decided_by, RouteAuthority::transfer_policy);
  // NF4 pays for block 3 but the plugin allowed only INT8, which does not pay: BF16.
  EXPECT_EQ(bridge.decide(3).precision, Precision::bf16);
  EXPECT_EQ(bridge.decide(3).decided_by, RouteAuthority::transfer_policy);
  EXPECT_EQ(bridge.decide(3).requested, Precision::int8);
  EXPECT_EQ(bridge.decide(4).precision, Precision::bf16);
  EXPECT_EQ(bridge.decide(4).decided_by, RouteAuthority::plugin);
  // A runtime pin to NF4 outranks the gate.
  RuntimeLimitHints pin;
  pin.block_precision_map[2] = Precision::nf4;
  bridge.tighten(pin);
  EXPECT_EQ(bridge.decide(2).precision, Precision::nf4);
  EXPECT_EQ(bridge.decide(2).decided_by, RouteAuthority::runtime_pin);
}

// A gate with no NF4 verdicts (a transfer policy measured before NF4): NF4 pays nowhere, so
// NF4 hints take INT8 where it pays and BF16 elsewhere.
TEST(PolicyBridge, AnInt8OnlyGateLetsNoNf4Through) {
  PolicyBridge bridge(3);
  const std::vector<Precision> hints = {Precision::nf4, Precision::nf4, Precision::int8};
  bridge.set_plugin_routes(hints);
  bridge.set_transfer_gate(gate_of({true, false, true}, {}));
  EXPECT_TRUE(bridge.has_transfer_gate());
  EXPECT_TRUE(bridge.transfer_gate().pays[Precision::nf4].empty());
  EXPECT_EQ(bridge.route(0), Precision::int8);
  EXPECT_EQ(bridge.route(1), Precision::bf16);
  EXPECT_EQ(bridge.route(2), Precision::int8);
  // An empty INT8 route likewise pays nowhere.
  bridge.set_transfer_gate(gate_of({}, {true, true, true}));
  EXPECT_EQ(bridge.route(0), Precision::nf4);
  EXPECT_EQ(bridge.route(2), Precision::bf16);
  bridge.clear_transfer_gate();
  EXPECT_FALSE(bridge.has_transfer_gate());
  EXPECT_EQ(bridge.route(1), Precision::nf4);
}

TEST(PolicyBridge, ATransferGateWithVerdictsForBf16IsRejected) {
  PolicyBridge bridge(3);
  TransferGate gate = gate_of({true, true, true});
  gate.pays[Precision::bf16] = {false, false, false};
  EXPECT_THAT([&] { bridge.set_transfer_gate(gate); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("the transfer gate has verdicts for bf16")));
}

TEST(PolicyBridge, ATransferGateOfTheWrongSizeNamesTheRouteAndKeepsTheOldGate) {
  PolicyBridge bridge(3);
  bridge.set_transfer_gate(gate_of({true, true, true}, {}));
  EXPECT_THAT(
      [&] {
        bridge.set_transfer_gate(gate_of({true, true, true}, {true}));
      },
      ::testing::ThrowsMessage<std::invalid_argument>(
          HasSubstr("the transfer gate has 1 entries in nf4_pays; expected none or one "
                    "per block (3)")));
  EXPECT_EQ(bridge.transfer_gate().pays[Precision::int8].size(), 3u);
  EXPECT_TRUE(bridge.transfer_gate().pays[Precision::nf4].empty());
}

TEST(PolicyBridge, RoutesOfAnotherCountAreRejectedAndTheOldOnesStay) {
  PolicyBridge bridge(2);
  bridge.set_plugin_routes({Precision::int8, Precision::bf16});
  EXPECT_THAT([&] { bridge.set_plugin_routes({Precision::bf16}); },
              ::testing::ThrowsMessage<std::invalid_argument>(
                  HasSubstr("PolicyBridge::set_plugin_routes: 1 routes; expected one per block (2)")));
  EXPECT_EQ(bridge.route(0), Precision::int8);
}

TEST(PolicyBridge, LimitsOnlyTightenWithinAStepAndResetAtStepBegin) {
  PolicyBridge bridge(4);
  const std::vector<Precision> hints = {Precision::int8, Precision::int8, Precision::int8, Precision::int8};
  bridge.set_plugin_routes(hints);
  bridge.begin_step();
  EXPECT_EQ(bridge.lookahead(4), 4u);

  RuntimeLimitHints first;
  first.prefetch_window_cap = 2;
  first.block_precision_map[1] = Precision::bf16;
  bridge.tighten(first);
  RuntimeLimitHints looser;
  looser.prefetch_window_cap = 3;
  looser.max_inflight_h2d = 1;
  looser.block_precision_map[1] = Precision::int8;  // a pin stays until the step ends
  looser.block_precision_map[2] = Precision::bf16;
  bridge.tighten(looser);
  RuntimeLimitHints unset;
  bridge.tighten(unset);  // unset fields loosen nothing

  EXPECT_EQ(*bridge.limits().prefetch_window_cap, 2u);
  EXPECT_EQ(bridge.lookahead(4), 1u);
  EXPECT_EQ(bridge.route(1), Precision::bf16);
  EXPECT_EQ(bridge.route(2), Precision::bf16);
  EXPECT_EQ(bridge.route(3), Precision::int8);
  EXPECT_FALSE(bridge.limits().suppress_speculative);

  bridge.begin_step();
  EXPECT_EQ(bridge.lookahead(4), 4u);
  EXPECT_EQ(bridge.route(1), Precision::int8);
}

TEST(PolicyBridge, UnknownBlockInThePrecisionMapIsRejected) {
  PolicyBridge bridge(2);
  RuntimeLimitHints limits;
  limits.block_precision_map[2] = Precision::bf16;
  EXPECT_THAT([&] { bridge.tighten(limits); },
              ::testing::ThrowsMessage<std::invalid_argument>(HasSubstr("block id 2")));
  EXPECT_THROW(bridge.route(2), std::invalid_argument);
}

}  // namespace
}  // namespace sp::adapters
