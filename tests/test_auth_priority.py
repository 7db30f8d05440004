"""The priority gate: reservation for high, refusal codes, class order, fairness within a class, the bounded queue."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import trio
import trio.testing

from narwhal.auth.gate_state import PRIORITY_ORDER, GateState, Queued, Ticket, Waiter, reserved_slots
from narwhal.auth.priority import GateRefused, PriorityGate

FAR = 1e9   # a deadline never reached


class Crowd:
    """Requests entering a gate each in its own task; what became of each, by name, in order."""

    def __init__(self, gate: PriorityGate, nursery: trio.Nursery) -> None:
        self.gate = gate
        self.nursery = nursery
        self.log: list[tuple[str, str]] = []
        self.tickets: dict[str, Ticket] = {}
        self.waited: dict[str, float] = {}
        self.scopes: dict[str, trio.CancelScope] = {}

    async def send(self, name: str, tenant: str, priority: str, deadline: float = FAR) -> None:
        """Start one request and return once it is admitted, queued or refused."""
        scope = self.scopes[name] = trio.CancelScope()

        async def run() -> None:
            with scope:
                try:
                    ticket, waited = await self.gate.enter(tenant, priority, deadline)
                except GateRefused as exc:
                    self.log.append((name, exc.code))
                    return
                except trio.TooSlowError:
                    self.log.append((name, "too_slow"))
                    return
                self.tickets[name], self.waited[name] = ticket, waited
                self.log.append((name, "in"))
                return
            self.log.append((name, "cancelled"))

        self.nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()

    def admitted(self) -> list[str]:
        return [name for name, outcome in self.log if outcome == "in"]


def fill(gate: PriorityGate, n: int, priority: str = "normal", tenant: str = "t") -> list[Ticket]:
    return [gate.try_enter(tenant, priority) for _ in range(n)]


def take(state: GateState, tenant: str, priority: str) -> Ticket:
    """A slot from the core, which must have one free."""
    got = state.try_enter(tenant, priority)
    assert isinstance(got, Ticket)
    return got


def refusal(gate: PriorityGate, priority: str, tenant: str = "t") -> tuple[str, float]:
    with pytest.raises(GateRefused) as caught:
        gate.try_enter(tenant, priority)
    return caught.value.code, caught.value.retry_after_s


# -- the reserve and the refusal codes -----------------------------------------------------------------

@pytest.mark.parametrize(("capacity", "reserve_high", "reserved"), [
    (10, 0.0, 0), (10, 0.1, 1), (10, 0.25, 2), (5, 0.1, 1), (100, 0.29, 29), (1, 0.5, 1), (2, 0.9, 1), (4, 0.5, 2)])
def test_the_reserve_is_the_floor_of_the_share_at_least_one_and_leaves_one_slot_to_the_others(
        capacity: int, reserve_high: float, reserved: int) -> None:
    assert reserved_slots(capacity, reserve_high) == reserved
    assert GateState(capacity=capacity, reserve_high=reserve_high, max_queue=0).reserved == reserved


def test_normal_and_low_never_take_the_reserved_slots_and_high_takes_them_all() -> None:
    gate = PriorityGate(capacity=4, reserve_high=0.25, max_queue=8)
    fill(gate, 2, "normal")
    fill(gate, 1, "low")
    # Only the reserved slot is free: normal and low are over their share.
    assert refusal(gate, "normal") == ("overloaded", 1.0)
    assert refusal(gate, "low") == ("overloaded", 1.0)
    fill(gate, 1, "high")
    # Every slot in use: saturated for everyone, high included.
    assert refusal(gate, "high") == ("pool_saturated", 1.0)
    assert refusal(gate, "normal") == ("pool_saturated", 1.0)
    assert gate.stats() == {"high": {"in_use": 1, "waiting": 0}, "normal": {"in_use": 2, "waiting": 0},
                            "low": {"in_use": 1, "waiting": 0}}

    only_high = PriorityGate(capacity=4, reserve_high=0.5, max_queue=8)
    fill(only_high, 4, "high")
    assert only_high.stats()["high"]["in_use"] == 4


def test_an_unknown_class_is_a_value_error_and_a_second_leave_raises() -> None:
    gate = PriorityGate(capacity=2, reserve_high=0.0, max_queue=0)
    with pytest.raises(ValueError, match="priority"):
        gate.try_enter("t", "urgent")
    ticket = gate.try_enter("t", "normal")
    gate.leave(ticket)
    with pytest.raises(ValueError, match="left twice"):
        gate.leave(ticket)
    # The slot was freed once: in_use is not driven below zero.
    assert gate.stats()["normal"]["in_use"] == 0
    assert len(fill(gate, 2)) == 2


async def test_the_common_path_is_no_checkpoint_and_counts_every_tenant() -> None:
    gate = PriorityGate(capacity=8, reserve_high=0.25, max_queue=8)
    with trio.testing.assert_no_checkpoints():
        a = gate.try_enter("a", "normal")
        b, waited = await gate.enter("b", "high", FAR)
        c = gate.try_enter("a", "low")
    assert waited == 0.0
    assert gate.tenants() == {"a": 2, "b": 1}
    for ticket in (a, b, c):
        gate.leave(ticket)
    assert gate.tenants() == {}


# -- the queue: class order, no overtaking, fairness ----------------------------------------------------

async def test_a_freed_slot_goes_to_the_waiter_never_to_an_arrival_of_its_class(nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=8)
    crowd = Crowd(gate, nursery)
    [held] = fill(gate, 1)
    await crowd.send("w1", "a", "normal")
    gate.leave(held)
    # The slot is w1's from the moment it freed, before w1's task runs: an arrival cannot take it.
    assert refusal(gate, "normal", "b")[0] == "pool_saturated"
    await crowd.send("w2", "b", "normal")
    await trio.testing.wait_all_tasks_blocked()
    assert crowd.admitted() == ["w1"]
    assert gate.stats()["normal"] == {"in_use": 1, "waiting": 1}


async def test_high_is_not_held_behind_lower_waiters_and_lower_classes_wait_behind_high(
        nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=2, reserve_high=0.5, max_queue=8)
    crowd = Crowd(gate, nursery)
    [normal] = fill(gate, 1, "normal")
    await crowd.send("n1", "a", "normal")
    # n1 waits for the shared slot; high takes the reserved one at once.
    await crowd.send("h1", "b", "high")
    assert crowd.admitted() == ["h1"]
    await crowd.send("h2", "b", "high")
    gate.leave(normal)
    await trio.testing.wait_all_tasks_blocked()
    # The freed slot went to the high waiter, not to n1 who came first.
    assert crowd.admitted() == ["h1", "h2"]
    assert gate.stats()["normal"]["waiting"] == 1


async def test_slots_are_given_high_then_normal_then_low_whatever_the_arrival_order(nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=8)
    crowd = Crowd(gate, nursery)
    [held] = fill(gate, 1)
    for name, priority in [("l1", "low"), ("n1", "normal"), ("l2", "low"), ("h1", "high"), ("n2", "normal")]:
        await crowd.send(name, name, priority)
    order = []
    for _ in range(5):
        gate.leave(held)
        await trio.testing.wait_all_tasks_blocked()
        [name] = [n for n in crowd.admitted() if n not in order]
        order.append(name)
        held = crowd.tickets[name]
    assert order == ["h1", "n1", "n2", "l1", "l2"]


def test_the_tenant_with_fewest_in_flight_in_its_class_goes_first_then_the_earliest() -> None:
    state = GateState(capacity=4, reserve_high=0.0, max_queue=8)
    held = [take(state, "busy", "normal") for _ in range(3)]
    held.append(take(state, "quiet", "high"))  # another class: not counted against quiet's normal share
    first = state.arrive("busy", "normal", 0.0)
    second = state.arrive("quiet", "normal", 0.0)
    third = state.arrive("other", "normal", 0.0)
    assert isinstance(first, Queued) and isinstance(second, Queued) and isinstance(third, Queued)
    # busy came first but has 3 in flight; quiet and other have none: the earlier of them goes first.
    assert list(state.leave(held[0])) == [second.waiter]
    assert list(state.leave(held[1])) == [third.waiter]
    # busy (1 in flight) against nobody else waiting.
    assert list(state.leave(held[2])) == [first.waiter]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_closed_loop_clients_share_equally_when_their_in_flight_counts_tie(seed: int) -> None:
    # Each client sends its next request as its last ends (the bench's clients): 8 light, 80 heavy, 8 slots.
    # In flight ties at 4 and 4 most of the time; the tie goes to the tenant served longest ago, not to the one
    # whose oldest waiter is oldest (the heavy tenant's always is: its queue is ten times longer).
    rng = random.Random(seed)
    state = GateState(capacity=8, reserve_high=0.0, max_queue=1_000_000)
    held: list = []
    for tenant, clients in (("light", 8), ("heavy", 80)):
        for _ in range(clients):
            outcome = state.arrive(tenant, "normal", 0.0)
            if not hasattr(outcome, "waiter"):
                held.append(outcome)
    admitted: list[str] = []
    while len(admitted) < 1000:
        ticket = held.pop(rng.randrange(len(held)))
        tenant = ticket.tenant
        for waiter in state.leave(ticket):
            held.append(waiter.ticket)
            admitted.append(waiter.tenant)
        outcome = state.arrive(tenant, "normal", 0.0)  # the client's next request
        if not hasattr(outcome, "waiter"):
            held.append(outcome)
    counts = Counter(admitted[:1000])
    assert counts["light"] >= 400 and counts["heavy"] >= 400, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_two_tenants_of_one_class_share_equally_while_both_wait_one_sending_ten_times_more(seed: int) -> None:
    rng = random.Random(seed)
    state = GateState(capacity=8, reserve_high=0.0, max_queue=1_000_000)
    # The heavy tenant holds every slot to begin with: the light one starts from nothing.
    held = [take(state, "heavy", "normal") for _ in range(8)]
    admitted: list[str] = []
    while len(admitted) < 1000:
        for _ in range(10):
            state.arrive("heavy", "normal", 0.0)
        state.arrive("light", "normal", 0.0)
        # Both wait at every admission (the light tenant's queue only grows: it arrives as fast as it is served).
        assert set(state.waiting_tenants("normal")) == {"heavy", "light"}
        ticket = held.pop(rng.randrange(len(held)))
        for waiter in state.leave(ticket):
            assert waiter.ticket is not None
            held.append(waiter.ticket)
            admitted.append(waiter.tenant)
    counts = Counter(admitted[:1000])
    assert counts["light"] >= 400 and counts["heavy"] >= 400, counts


async def test_tenants_waiting_through_the_gate_share_it_equally_one_arriving_eight_times_faster(
        autojump_clock: trio.testing.MockClock) -> None:
    rng = random.Random(7)
    gate = PriorityGate(capacity=4, reserve_high=0.0, max_queue=100_000)
    admitted: list[str] = []

    async def request(tenant: str) -> None:
        ticket, _ = await gate.enter(tenant, "normal", FAR)
        admitted.append(tenant)
        await trio.sleep(rng.uniform(0.5, 1.5))
        gate.leave(ticket)

    async def arrivals(nursery: trio.Nursery, tenant: str, per_s: float) -> None:
        while True:
            nursery.start_soon(request, tenant)
            await trio.sleep(1 / per_s)

    # 4 slots of about 1 s each: 4 admissions a second. The light tenant sends 2.5 a second, more than its
    # half, so both keep waiting; the heavy one sends 20.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrivals, nursery, "heavy", 20.0)
        nursery.start_soon(arrivals, nursery, "light", 2.5)
        while len(admitted) < 1000:
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    counts = Counter(admitted[:1000])
    assert counts["light"] >= 400 and counts["heavy"] >= 400, counts


# -- the queue's bound, deadline and cancellation ---------------------------------------------------------

async def test_a_full_queue_sheds_the_newest_of_the_lowest_class_for_a_higher_arrival(
        nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=2)
    crowd = Crowd(gate, nursery)
    fill(gate, 1)
    await crowd.send("l1", "a", "low")
    await crowd.send("l2", "b", "low")
    await crowd.send("n1", "c", "normal")
    # l2, the newest low, made room for n1.
    assert crowd.log == [("l2", "queue_full")]
    await crowd.send("l3", "d", "low")
    assert crowd.log[-1] == ("l3", "queue_full")     # its class is the lowest waiting: no room
    await crowd.send("h1", "e", "high")
    assert crowd.log[-1] == ("l1", "queue_full")     # the last low shed for high
    await crowd.send("l4", "f", "low")
    assert crowd.log[-1] == ("l4", "overloaded")     # lower than everyone waiting: its class is over its share
    await crowd.send("n2", "g", "normal")
    assert crowd.log[-1] == ("n2", "queue_full")
    assert gate.stats() == {"high": {"in_use": 0, "waiting": 1}, "normal": {"in_use": 1, "waiting": 1},
                            "low": {"in_use": 0, "waiting": 0}}


async def test_no_queue_refuses_at_once_with_queue_full(nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=0)
    crowd = Crowd(gate, nursery)
    fill(gate, 1)
    await crowd.send("n1", "a", "normal")
    assert crowd.log == [("n1", "queue_full")]


async def test_a_waiter_leaves_the_queue_at_its_deadline_and_reports_the_time_it_waited(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=4)
    crowd = Crowd(gate, nursery)
    [held] = fill(gate, 1)
    start = trio.current_time()
    await crowd.send("late", "a", "normal", deadline=start + 5)
    await crowd.send("patient", "b", "normal", deadline=start + 60)
    await trio.sleep(4.9)
    assert crowd.log == []
    await trio.sleep(0.2)
    assert crowd.log == [("late", "too_slow")]
    assert gate.stats()["normal"] == {"in_use": 1, "waiting": 1}
    await trio.sleep(2.9)   # 8 s after patient arrived
    gate.leave(held)
    await trio.testing.wait_all_tasks_blocked()
    assert crowd.admitted() == ["patient"]
    assert crowd.waited["patient"] == pytest.approx(8.0)


async def test_a_cancelled_waiter_leaves_the_queue_and_the_next_slot_goes_to_the_next(
        nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=4)
    crowd = Crowd(gate, nursery)
    [held] = fill(gate, 1)
    await crowd.send("w1", "a", "normal")
    await crowd.send("w2", "b", "normal")
    crowd.scopes["w1"].cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert crowd.log == [("w1", "cancelled")]
    assert gate.stats()["normal"]["waiting"] == 1
    gate.leave(held)
    await trio.testing.wait_all_tasks_blocked()
    assert crowd.admitted() == ["w2"]


async def test_a_slot_granted_to_a_waiter_cancelled_at_that_moment_goes_to_the_next_one(
        nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=4)
    crowd = Crowd(gate, nursery)
    [held] = fill(gate, 1)
    await crowd.send("w1", "a", "normal")
    await crowd.send("w2", "b", "normal")
    # w1 is cancelled, and before its task runs again the slot frees and the core grants it to w1.
    crowd.scopes["w1"].cancel()
    gate.leave(held)
    await trio.testing.wait_all_tasks_blocked()
    assert crowd.log == [("w1", "cancelled"), ("w2", "in")]
    assert gate.stats()["normal"] == {"in_use": 1, "waiting": 0}
    assert gate.tenants() == {"b": 1}
    gate.leave(crowd.tickets["w2"])
    assert gate.stats()["normal"]["in_use"] == 0


async def test_a_waiter_woken_then_cancelled_still_gets_its_ticket(nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=4)
    crowd = Crowd(gate, nursery)
    [held] = fill(gate, 1)
    await crowd.send("w1", "a", "normal")
    # Woken first: trio delivers the wake-up, so the slot is w1's to leave (not lost, not given twice).
    gate.leave(held)
    crowd.scopes["w1"].cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert crowd.log == [("w1", "in")]
    assert gate.tenants() == {"a": 1}


async def test_a_slot_granted_as_the_deadline_passes_is_not_lost(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=4)
    crowd = Crowd(gate, nursery)
    [held] = fill(gate, 1)
    deadline = trio.current_time() + 5
    await crowd.send("w1", "a", "normal", deadline=deadline)
    await crowd.send("w2", "b", "normal")
    # Wake exactly at w1's deadline and free the slot before w1's task runs: it may take it or time out,
    # and if it timed out the slot went to w2.
    await trio.sleep_until(deadline)
    gate.leave(held)
    await trio.testing.wait_all_tasks_blocked()
    assert gate.stats()["normal"]["in_use"] == 1
    assert crowd.log in ([("w1", "in")], [("w1", "too_slow"), ("w2", "in")])


# -- reconfiguration ----------------------------------------------------------------------------------------

async def test_a_smaller_capacity_keeps_requests_in_flight_and_admits_nobody_until_below_it(
        nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=4, reserve_high=0.0, max_queue=4)
    crowd = Crowd(gate, nursery)
    held = fill(gate, 4)
    await crowd.send("w1", "a", "normal")
    gate.reconfigure(capacity=2, reserve_high=0.0, max_queue=4)
    assert gate.stats()["normal"]["in_use"] == 4
    for ticket in held[:2]:
        gate.leave(ticket)
        await trio.testing.wait_all_tasks_blocked()
        assert crowd.admitted() == []
    gate.leave(held[2])
    await trio.testing.wait_all_tasks_blocked()
    assert crowd.admitted() == ["w1"]
    assert gate.stats()["normal"]["in_use"] == 2


async def test_a_larger_capacity_admits_waiters_at_once_and_a_shorter_queue_sheds_the_lowest(
        nursery: trio.Nursery) -> None:
    gate = PriorityGate(capacity=1, reserve_high=0.0, max_queue=8)
    crowd = Crowd(gate, nursery)
    fill(gate, 1)
    for name, priority in [("n1", "normal"), ("l1", "low"), ("h1", "high"), ("l2", "low"), ("n2", "normal")]:
        await crowd.send(name, name, priority)
    # Two more slots, one reserved for high: h1 and n1 enter; a queue of one keeps n2 and sheds l2, l1.
    gate.reconfigure(capacity=3, reserve_high=0.34, max_queue=1)
    await trio.testing.wait_all_tasks_blocked()
    assert sorted(crowd.admitted()) == ["h1", "n1"]
    assert sorted(name for name, outcome in crowd.log if outcome == "queue_full") == ["l1", "l2"]
    assert gate.stats()["normal"] == {"in_use": 2, "waiting": 1}
    # Every normal slot in use and the reserve free: a normal try is over its share.
    gate.leave(crowd.tickets["h1"])
    assert refusal(gate, "normal")[0] == "overloaded"


# -- invariants under random traffic -----------------------------------------------------------------------

class Model:
    """What a caller of the core holds: live tickets and waiters not yet settled."""

    def __init__(self) -> None:
        self.held: list[Ticket] = []
        self.waiting: list[Waiter] = []
        self.granted: list[Waiter] = []     # admitted waiters whose ticket is still held

    def settle(self, waiters: object) -> None:
        assert isinstance(waiters, (list, tuple))
        for waiter in waiters:
            assert isinstance(waiter, Waiter)
            self.waiting.remove(waiter)
            if waiter.ticket is not None:
                self.held.append(waiter.ticket)
                self.granted.append(waiter)
            else:
                assert waiter.refusal == "queue_full"


def check(state: GateState, model: Model, before: dict[str, dict[str, int]]) -> None:
    stats = state.stats()
    total = sum(s["in_use"] for s in stats.values())
    shared = stats["normal"]["in_use"] + stats["low"]["in_use"]
    was_total = sum(s["in_use"] for s in before.values())
    was_shared = before["normal"]["in_use"] + before["low"]["in_use"]
    share = state.capacity - state.reserved
    # Within capacity, unless a smaller capacity left more in flight: then it never grows.
    assert total <= state.capacity or total <= was_total
    assert shared <= share or shared <= was_shared
    assert sum(s["waiting"] for s in stats.values()) <= state.max_queue
    # Nobody waits while a slot is free for its class (and so nobody of a higher class waits ahead).
    for name in PRIORITY_ORDER:
        if stats[name]["waiting"]:
            assert not state.free_for(name), (name, stats, state.capacity, state.reserved)
    # The counts are what the caller holds.
    assert total == len(model.held) and all(t.live for t in model.held)
    assert Counter(state.tenants()) == Counter(t.tenant for t in model.held)
    for rank, name in enumerate(PRIORITY_ORDER):
        assert stats[name]["waiting"] == sum(1 for w in model.waiting if w.rank == rank)
        assert stats[name]["in_use"] == sum(1 for t in model.held if t.rank == rank)


@pytest.mark.parametrize("seed", range(6))
def test_the_invariants_hold_after_every_step_of_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    tenants = ["a", "b", "c", "d"]
    state = GateState(capacity=4, reserve_high=0.25, max_queue=5)
    model = Model()
    for step in range(3000):
        before = state.stats()
        roll = rng.random()
        if roll < 0.45:
            got = state.arrive(rng.choice(tenants), rng.choice(PRIORITY_ORDER), float(step))
            if isinstance(got, Ticket):
                model.held.append(got)
            elif isinstance(got, Queued):
                model.waiting.append(got.waiter)
                if got.shed is not None:
                    model.settle([got.shed])
            else:
                # A refusal from the queue only when it is full.
                assert sum(s["waiting"] for s in before.values()) == state.max_queue
        elif roll < 0.55:
            got_now = state.try_enter(rng.choice(tenants), rng.choice(PRIORITY_ORDER))
            if isinstance(got_now, Ticket):
                model.held.append(got_now)
        elif roll < 0.85 and model.held:
            ticket = model.held.pop(rng.randrange(len(model.held)))
            model.granted = [w for w in model.granted if w.ticket is not ticket]
            model.settle(state.leave(ticket))
        elif roll < 0.93 and model.waiting:
            waiter = rng.choice(model.waiting)
            model.waiting.remove(waiter)
            assert state.abandon(waiter) == ()
            assert state.abandon(waiter) == ()      # a second abandon is nothing
        elif roll < 0.97 and model.granted:
            # Granted, then cancelled before its task ran: the slot goes to the next waiter.
            waiter = model.granted.pop(rng.randrange(len(model.granted)))
            assert waiter.ticket is not None
            model.held.remove(waiter.ticket)
            model.settle(state.abandon(waiter))
        else:
            model.settle(state.configure(capacity=rng.randint(1, 6), reserve_high=rng.choice([0.0, 0.2, 0.5]),
                                         max_queue=rng.randint(0, 6)))
        check(state, model, before)
