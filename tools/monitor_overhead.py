"""What FP8Monitor costs, measured piece by piece (robust on a busy machine).

Model: the demo's MLP (keras_fp8.demo.build_model, 64 -> 256 -> 256 -> 10),
fp8_hybrid with min_gemm_size=0, the digits data set, batch 64. Measures

- a training step without the monitor: `model.fit` time per step;
- a monitored step's extra work: `FP8Monitor.measure` (the probe's forward
  and backward on a batch of 64, the statistics of 3 layers x 3 roles, one
  transfer to the host), with and without a probe batch;
- an unmonitored step's extra work: the callback's `on_train_batch_end`
  when it does not measure;
- what the layers pay without any monitor: the observer check (the
  layer's GEMM observer read, None outside a probe), once per eager FP8
  call;

each as the minimum and the median over repeats (the minimum is the run the
other processes disturbed least), and derives the overhead at
`every_n_steps` = 10, 50, 200.

    KERAS_BACKEND=torch python tools/monitor_overhead.py --threads 1
"""

import argparse
import statistics
import time
import timeit

import keras

import keras_fp8
from keras_fp8 import demo
from keras_fp8 import inspection


def timed(fn, repeats):
    values = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        values.append(time.perf_counter() - start)
    return min(values), statistics.median(values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(args.threads)
    (x, y), _ = demo.load_digits(0)
    batch = 64
    keras.mixed_precision.set_global_policy(keras_fp8.FP8DTypePolicy("fp8_hybrid", min_gemm_size=0))
    keras.utils.set_random_seed(0)
    model = demo.build_model(x.shape[1], 10)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x_fit, y_fit = x[:batch * 8], y[:batch * 8]
    model.fit(x_fit, y_fit, batch_size=batch, epochs=1, verbose=0)  # compiles, fills caches

    step = timed(lambda: model.fit(x_fit, y_fit, batch_size=batch, epochs=1, verbose=0), args.repeats)
    step = tuple(t / 8 for t in step)

    with_probe = keras_fp8.callbacks.FP8Monitor(1, probe=(x[:batch], y[:batch]), logs=None)
    without_probe = keras_fp8.callbacks.FP8Monitor(1, logs=None)
    for monitor in (with_probe, without_probe):
        monitor.set_model(model)
        monitor.measure(model)  # compiles (JAX), converts the probe batch
    measure_probe = timed(lambda: with_probe.measure(model), args.repeats)
    measure_state = timed(lambda: without_probe.measure(model), args.repeats)

    idle = keras_fp8.callbacks.FP8Monitor(10**9, logs=None)
    idle.set_model(model)
    idle.step = 1
    calls = 100_000
    unmonitored = min(timeit.repeat(lambda: idle.on_train_batch_end(0, {}), number=calls, repeat=5)) / calls
    layer = inspection.fp8_layers(model)[0]
    check = min(timeit.repeat(lambda: layer._gemm_observer, number=calls, repeat=5)) / calls

    ms = 1e3
    print(f"{keras.backend.backend()} backend, {args.repeats} repeats, min / median")
    print(f"training step, no monitor:          {step[0] * ms:7.2f} / {step[1] * ms:7.2f} ms")
    print(f"FP8Monitor.measure, probe batch:    {measure_probe[0] * ms:7.2f} / {measure_probe[1] * ms:7.2f} ms")
    print(f"FP8Monitor.measure, no probe batch: {measure_state[0] * ms:7.2f} / {measure_state[1] * ms:7.2f} ms")
    print(f"unmonitored step's callback:        {unmonitored * 1e6:7.3f} us")
    print(f"observer check per FP8 call:        {check * 1e9:7.1f} ns")
    for n in (10, 50, 200):
        print(f"every_n_steps={n:<4d} overhead with a probe batch: "
              f"{100 * measure_probe[0] / (n * step[0]):5.1f}% (min), "
              f"{100 * measure_probe[1] / (n * step[1]):5.1f}% (median)")


if __name__ == "__main__":
    main()
