"""Decoupled DiLoCo's merge rule (`diloco_jax.quorum`), the one both clocks run: each case's
expected merges worked out by hand from the rule's statement."""

import math

from diloco_jax.quorum import Due, QuorumRule, fixed_grace


def test_a_sync_is_due_its_grace_after_its_kth_push_and_takes_the_pushes_in_by_then():
    rule = QuorumRule(fragments=1, quorum=2, grace=fixed_grace(1.0))
    assert rule.push(0, 0, 2, now=1.0)
    assert rule.next_due() is None  # one push of two
    assert rule.push(0, 0, 0, now=2.0)
    assert rule.next_due() == Due(3.0, 0, 0)  # the 2nd push at 2 s, plus 1 s
    assert rule.push(0, 0, 1, now=2.5)  # inside the window: taken
    assert rule.merge(rule.next_due(), now=3.0) == (0, 1, 2)
    assert not rule.push(0, 0, 3, now=3.5)  # its sync merged: late
    assert rule.next_sync == [1]


def test_a_fragments_syncs_merge_in_order_and_ties_go_to_the_lower_fragment():
    rule = QuorumRule(fragments=2, quorum=1, grace=fixed_grace(0.0))
    rule.push(0, 1, 0, now=1.0)  # fragment 0's sync 1 before its sync 0: not due
    assert rule.next_due() is None
    rule.push(1, 0, 1, now=2.0)
    rule.push(0, 0, 1, now=2.0)
    assert rule.next_due() == Due(2.0, 0, 0)  # a tie at 2 s: fragment 0 first
    assert rule.merge(Due(2.0, 0, 0), now=2.5) == (1,)
    # Sync (0, 1) had its quorum at 1 s; it is due no earlier than (0, 0)'s merge at 2.5 s,
    # so (1, 0), due at 2 s, goes first.
    assert rule.next_due() == Due(2.0, 1, 0)
    assert rule.merge(rule.next_due(), now=2.6) == (1,)
    assert rule.next_due() == Due(2.5, 0, 1)
    assert rule.merge(rule.next_due(), now=2.7) == (0,)


def test_a_learners_second_push_of_a_sync_counts_once():
    rule = QuorumRule(fragments=1, quorum=2, grace=fixed_grace(0.0))
    rule.push(0, 0, 4, now=1.0)
    rule.push(0, 0, 4, now=2.0)
    assert rule.next_due() is None
    rule.push(0, 0, 5, now=3.0)
    assert rule.next_due() == Due(3.0, 0, 0)


def test_the_grace_is_told_the_first_and_kth_pushes_and_the_kth_learner():
    told = []

    def grace(first, quorum, learner):
        told.append((first, quorum, learner))
        return 0.25

    rule = QuorumRule(fragments=1, quorum=3, grace=grace)
    for learner, at in [(2, 1.0), (0, 4.0), (1, 6.0)]:
        rule.push(0, 0, learner, now=at)
    assert told == [(1.0, 6.0, 1)]
    assert rule.next_due() == Due(6.25, 0, 0)


def test_a_resumed_rule_starts_from_the_saved_syncs_with_no_pushes_in():
    rule = QuorumRule(fragments=2, quorum=1, grace=fixed_grace(0.0))
    rule.push(0, 3, 0, now=1.0)
    rule.resume([3, 5])
    assert rule.next_due() is None and rule.last_merge == [-math.inf, -math.inf]
    assert not rule.push(1, 4, 0, now=2.0)  # before fragment 1's next sync: late
    assert rule.push(0, 3, 0, now=2.0)
    assert rule.next_due() == Due(2.0, 0, 3)
