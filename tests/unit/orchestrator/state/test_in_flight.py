"""``InFlight.ended``, kept as counts change, is what its definition reads off every scraped instance."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.orchestrator.state.in_flight import InFlight

AGENTS = ("a", "b", "c")
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(AGENTS)),
        st.tuples(st.just("remove"), st.sampled_from(AGENTS)),
        st.tuples(st.just("scraped"), st.sampled_from(AGENTS)),
        st.tuples(st.just("forget"), st.sampled_from(AGENTS)),
        st.tuples(st.just("remote"), st.dictionaries(st.sampled_from(AGENTS), st.integers(0, 3))),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_ended_is_at_scrape_less_the_fewest_since_wherever_positive(steps: list[tuple[str, object]]) -> None:
    flight = InFlight()
    for op, arg in steps:
        if op == "remote":
            assert isinstance(arg, dict)
            flight.set_remote("peer", arg)
        else:
            assert isinstance(arg, str)
            getattr(flight, op)(arg)
        # The definition: per scraped instance, in flight at its scrape less the fewest since.
        expected = {}
        for agent_id in AGENTS:
            at = flight.at_scrape(agent_id)
            if agent_id in flight._at_scrape and at > flight._low[agent_id]:
                expected[agent_id] = at - flight._low[agent_id]
        assert flight.ended() == expected
