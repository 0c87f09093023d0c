"""Pathological reward functions for the reward pool tests, loaded by the workers as "reward_fns:NAME"
(tests/unit is on the test process's sys.path; the pool passes it on to the workers)."""
import ctypes
import os
import sys
import time


def answer_length(sample):
    """A well-behaved function: the length of the reference answer (distinct per sample)."""
    return float(len(sample.answer))


def sleepy(sample):
    """Sleeps 0.3 s, then 1.0: for the parallel speed-up test."""
    time.sleep(0.3)
    return 1.0


def hang_on_hang(sample):
    """Never returns when the response is "hang"; else 1.0."""
    while sample.response_text == "hang":
        time.sleep(0.05)
    return 1.0


def exit_on_exit(sample):
    """Ends the worker process abruptly (no exception) when the response is "exit"; else 1.0."""
    if sample.response_text == "exit":
        os._exit(3)
    return 1.0


def segfault(sample):
    """Dereferences a null pointer: the worker dies of SIGSEGV."""
    ctypes.string_at(0)
    return 1.0


def raises(sample):
    raise KeyError("no such field")


def nan(sample):
    return float("nan")


def text(sample):
    return "1.0"


def prints(sample):
    """Writes to stdout, which must not corrupt the worker's message pipe."""
    print("noise on stdout")
    return 0.5


def torch_loaded(sample):
    """1.0 when torch is imported in this (worker) process."""
    return float("torch" in sys.modules)


NOT_CALLABLE = 3


def first_token_odd(sample):
    """1.0 when the response's first token id is odd: varies within a group of a random model's samples,
    so a run with it learns (its advantages are not all zero)."""
    return float(sample.response_ids[0] % 2) if sample.response_ids else 0.0


def hangs(sample):
    """Never returns, whatever the response: a broken function. With sample.metadata["log"], first appends
    the sample's index to that file (which samples a worker started)."""
    if sample.metadata and "log" in sample.metadata:
        with open(sample.metadata["log"], "a") as log:
            log.write(f"{sample.sample_index}\n")
    while True:
        time.sleep(0.05)
