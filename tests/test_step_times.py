"""A syncer's measured step times (`diloco_jax.step_times`), by hand."""

from diloco_jax.step_times import StepTimes


def test_the_median_of_the_last_five_timings_and_none_for_an_untimed_worker():
    times = StepTimes()
    assert times[3] == 0.0 and times.timed() == []
    for seconds in (40.0, 2.0, 1.0, 3.0, 5.0, 4.0):  # 40 s falls out: median of 2, 1, 3, 5, 4
        times.add(3, seconds)
    times.add(1, 0.5)
    assert (times[3], times[1]) == (3.0, 0.5) and times.timed() == [1, 3]
    again = StepTimes(times.recent)  # what a restarted syncer gets from its checkpoint
    assert again.recent == {3: [2.0, 1.0, 3.0, 5.0, 4.0], 1: [0.5]}
    assert StepTimes({0: [9.0, 1.0, 1.0, 1.0, 1.0, 1.0]})[0] == 1.0  # trimmed to five
