"""The elastic syncers' membership (`diloco_jax.membership`): incarnations, reattaching,
silence, by hand on a clock the test sets."""

from diloco_jax.membership import Membership


def test_a_join_hands_out_an_incarnation_and_a_reattach_keeps_it():
    members = Membership()
    first = members.join(2, None, now=1.0)
    assert first.new and not first.replaced and set(members) == {2}
    again = members.join(2, first.member.incarnation, now=3.0)  # reattaching: the same one
    assert not again.new and again.member is first.member and members[2].last_seen == 3.0
    other = members.join(2, "an-incarnation-it-never-had", now=4.0)  # a new process
    assert other.new and other.replaced
    assert other.member.incarnation not in (first.member.incarnation, "an-incarnation-it-never-had")


def test_only_the_held_incarnation_is_heard():
    members = Membership()
    me = members.join(0, None, now=0.0).member.incarnation
    assert not members.heard(0, "stale", now=5.0) and members[0].last_seen == 0.0
    assert not members.heard(1, me, now=5.0)  # not a member
    assert members.heard(0, me, now=5.0) and members[0].last_seen == 5.0


def test_silent_members_are_those_past_the_timeout_and_busy_time_counts_for_nobody():
    members = Membership()
    for worker, at in [(0, 0.0), (1, 2.0), (2, 4.0)]:
        members.join(worker, None, now=at)
    assert members.silent(now=4.5, timeout=3.0) == [(0, 4.5)]  # 1 is 2.5 s silent, 2 0.5 s
    assert members.silent(now=5.5, timeout=3.0) == [(0, 5.5), (1, 3.5)]
    members.excuse(1.0)  # the syncer was busy a second: nobody's silence grows by it
    assert members.silent(now=5.5, timeout=3.0) == [(0, 4.5)]
    members.remove(0)
    assert set(members) == {1, 2} and 0 not in members and len(members) == 2


def test_a_restarted_syncers_members_keep_their_incarnations():
    members = Membership({3: "abc", 5: "def"}, now=10.0)
    assert members.incarnations() == {3: "abc", 5: "def"}
    assert members.heard(3, "abc", now=11.0)
    assert not members.join(5, "def", now=11.0).new
