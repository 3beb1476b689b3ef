"""Asynchronous DiLoCo's server rule (`diloco_jax.arrival_rule`), the one the real syncer and
the simulated clock both run: each case worked out by hand from the rule's statement."""

from diloco_jax.arrival_rule import ArrivalRule, Job, age


def test_a_job_starts_after_the_updates_so_far_and_its_delta_ages_by_those_after():
    rule = ArrivalRule(inner_steps=4, dynamic_steps=False)
    job = rule.hand_out(worker=1, serial=7, updates=3, position=2, now=10.5)
    assert job == Job(serial=7, start_update=3, position=2, steps=4, started=10.5)
    assert rule.take(1, 7) == job
    assert age(job, 8) == 5  # applied after 8 updates: 5 since it started


def test_a_delta_of_a_job_not_in_hand_is_late():
    rule = ArrivalRule(inner_steps=2, dynamic_steps=False)
    rule.hand_out(0, serial=1, updates=0, position=0, now=0.0)
    assert rule.take(0, 2) is None  # another serial
    assert rule.take(1, 1) is None  # a worker with no job
    rule.hand_out(0, serial=3, updates=1, position=0, now=1.0)  # asked again: replaces it
    assert rule.take(0, 1) is None
    rule.drop(0)  # removed
    assert rule.take(0, 3) is None
    assert rule.jobs == {}


def test_dylu_counts_come_from_the_median_of_each_timed_workers_last_five_phases():
    rule = ArrivalRule(inner_steps=6, dynamic_steps=True)
    assert rule.steps(0) == 6  # nobody timed: H
    for seconds in (9.0, 1.0, 1.0, 1.0, 1.0, 1.0):  # the 9 s phase falls out of the last five
        rule.timed(0, seconds)
    for seconds in (3.0, 2.0, 100.0):  # median 3 s
        rule.timed(1, seconds)
    # v = (1, 1/3): floor(6 x 1) = 6, floor(6 x 1/3) = 2.
    assert (rule.steps(0), rule.steps(1)) == (6, 2)
    assert rule.steps(2) == 6  # not timed yet
    assert rule.hand_out(1, serial=0, updates=0, position=0, now=0.0).steps == 2


def test_without_dylu_every_job_has_h_steps_however_slow_its_worker():
    rule = ArrivalRule(inner_steps=3, dynamic_steps=False)
    rule.timed(0, 0.1)
    rule.timed(1, 50.0)
    assert (rule.steps(0), rule.steps(1)) == (3, 3)
