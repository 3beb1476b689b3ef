"""The elastic round's rule on a clock the test sets (`diloco_jax.round_rule`): every decision
written out by hand from the rule's text."""

from diloco_jax.round_rule import WAIT, Decision, RoundRule, Shortage


def _rule(m=3, k=2, grace=None, round_timeout=None, join=10.0, quorum=5.0):
    return RoundRule(m, k, grace_seconds=grace, round_timeout=round_timeout, join_timeout=join,
                     quorum_timeout=quorum)  # fmt: skip


def test_the_first_round_opens_for_everyone_or_after_join_timeout_with_the_quorum():
    rule = _rule()
    assert rule.decide(1.0, {0, 1}, set(), False, 0.0) == WAIT  # 2 of 3, before join_timeout
    assert rule.decide(2.0, {0, 1, 2}, set(), False, 0.0) == Decision(
        "open", frozenset({0, 1, 2}), "start"
    )
    assert rule.decide(10.0, {0, 1}, set(), False, 0.0) == Decision(
        "open", frozenset({0, 1}), "start"
    )
    # One worker at join_timeout: short of the quorum; the run ends past quorum_timeout.
    assert rule.decide(10.0, {2}, set(), False, 0.0) == WAIT
    assert rule.decide(15.0, {2}, set(), False, 0.0) == WAIT  # 5 s short: not more than 5
    assert rule.decide(15.5, {2}, set(), False, 0.0) == Decision("end", why="1 of 3 workers joined")


def test_a_resumed_round_opens_once_its_members_are_back():
    rule = _rule()
    # Member 2 of the checkpoint is not back: wait (even with the quorum present).
    assert rule.decide(1.0, {0, 1, 2}, {2}, True, 0.0) == WAIT
    assert rule.decide(1.0, {0, 1}, set(), True, 0.0) == Decision(
        "open", frozenset({0, 1}), "resumed"
    )


def test_a_sync_closes_when_every_live_participant_pushed_or_grace_after_the_quorum():
    rule = _rule(grace=3.0)
    rule.open({0, 1, 2}, now=100.0)
    assert rule.push(0, "a", 101.0) and rule.decide(101.0, {0, 1, 2}, set(), False, 0.0) == WAIT
    assert rule.push(1, "b", 102.0)  # the quorum (K = 2) at 102
    assert rule.decide(104.9, {0, 1, 2}, set(), False, 0.0) == WAIT  # 2.9 s of grace
    assert rule.decide(105.0, {0, 1, 2}, set(), False, 0.0) == Decision("close")
    assert rule.close() == {0: "a", 1: "b"} and not rule.is_open
    # Without grace: it waits for worker 2 until it leaves (removed), then closes.
    rule = _rule()
    rule.open({0, 1, 2}, now=0.0)
    rule.push(0, "a", 1.0)
    rule.push(1, "b", 1.0)
    assert rule.decide(500.0, {0, 1, 2}, set(), False, 0.0) == WAIT
    assert rule.decide(500.0, {0, 1}, set(), False, 0.0) == Decision("close")  # 2 not live


def test_a_push_counts_once_and_only_from_a_participant_of_an_open_round():
    rule = _rule()
    assert not rule.push(0, "a", 0.0)  # no round open
    rule.open({0, 1}, now=0.0)
    assert not rule.push(2, "c", 1.0)  # joined after the opening: from the next round
    assert rule.push(0, "a", 1.0) and rule.push(0, "again", 2.0)
    assert rule.pushed == {0: "a"} and rule.awaits(1) and not rule.awaits(0)
    rule.leave(0)  # its push is in: it stays
    rule.leave(1)
    assert rule.participants == {0} and not rule.awaits(1)


def test_stuck_participants_and_a_lost_quorum_reopen_or_end_the_run():
    rule = _rule(round_timeout=20.0)
    rule.open({0, 1, 2}, now=0.0)
    rule.push(0, "a", 1.0)
    assert rule.stuck(20.0, {0, 1, 2}) == []
    assert rule.stuck(20.5, {0, 2}) == [2]  # live and still to push; 1 is gone already
    # Workers 1 and 2 leave: one push plus no one waited for < K = 2: open again for the
    # members there, if they differ from the participants.
    rule.leave(1)
    rule.leave(2)
    assert rule.decide(21.0, {0, 3}, set(), False, 0.0) == Decision(
        "open", frozenset({0, 3}), "quorum lost"
    )
    rule.open({0}, now=21.0)
    assert rule.decide(22.0, {0}, set(), False, 0.0) == WAIT  # short from 22
    assert rule.decide(27.0, {0}, set(), False, 0.0) == WAIT
    assert rule.decide(27.5, {0}, set(), False, 0.0) == Decision("end", why="1 live workers")


def test_a_shortage_ends_after_its_timeout_unless_cleared():
    shortage = Shortage(2.0)
    assert not shortage.short(10.0) and not shortage.short(12.0) and shortage.short(12.1)
    shortage.clear()
    assert not shortage.short(12.2) and not shortage.short(14.2) and shortage.short(14.3)
