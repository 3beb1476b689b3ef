"""The language-model application built on the engine: a Flax NNX transformer (`model`), byte
data (`data`), run configurations (`config`), one run (`experiment`), the DiLoCo-vs-baselines
comparison (`compare`), the `diloco-jax` command (`cli`), plots and run logs. The engine
(`diloco_jax`) imports nothing from here. Submodules are imported on use, so the command's
argument errors stay fast."""
