"""The TRL side of benchmarks/peer_trl.py: GSPO on the CPU demo's task through Hugging Face TRL's GRPOTrainer.

Run by peer_trl.py with the python of its own TRL environment (runs/peer_trl/.venv-trl), never with the
project's: this file imports only TRL and its dependencies, not megatron_gspo. One process, `--threads`
torch threads, generation in-process with the policy's own `generate()`.

Settings matched to examples/tiny_cpu.yaml (peer_trl.py passes the numbers; the mapping is here):
- rollout step: `--prompts` prompts x `--group-size` samples = the generation batch
  (generation_batch_size = per_device_train_batch_size * steps_per_generation);
- `--minibatches` optimizer steps per generation batch: per_device_train_batch_size = batch / minibatches,
  steps_per_generation = minibatches, gradient_accumulation_steps = 1, num_iterations = 1 (each sample is
  trained on once, as the project's K disjoint mini-batches). TRL then computes pi_old's log-probs once per
  generation batch (gradient_accumulation_steps % steps_per_generation != 0), as `old_logprobs: recompute`;
- GSPO: importance_sampling_level="sequence" with loss_type="grpo" (the per-sequence mean, GSPO eq. 5-7),
  band epsilon / epsilon_high, beta=0 (no KL, no reference model), group-normalised advantages;
- Adam, constant lr, no warm-up, no weight decay, gradient-norm clip 1.0, float32, temperature 1.0, top_p 1,
  no top-k, `--max-new-tokens` new tokens.

The reward is written here (`--reward`), equivalent to megatron_gspo/rewards/verifiers.py's function of that
name: exact_match (the arithmetic task): 1.0 when the response's text before EOS (TRL decodes the completion
up to EOS, special tokens skipped), stripped, equals the stripped answer; final_answer (long_addition): 1.0
when the integer on the response's last "answer: N" line equals the answer, 0.0 otherwise (also when no such
line: the project scores that 0 and counts it as unparsed).

Output: one JSON line per rollout step in `--out` (rewards, seconds of the step, of generation, of pi_old's
log-prob recompute, of the rest of TRL's rollout phase: rewards, advantages, padding; the completion tokens
generated, EOS included), and a first line
{"event": "train_begin", "unix_time": ...} when the trainer is built and the first step begins, so that
peer_trl.py can measure the start-up from its own launch time.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def exact_match_reward(completions, answer, **_) -> list[float]:
    """TRL reward function: 1.0 where the completion's text (before EOS) stripped equals the answer stripped.

    `completions` are conversational ([{"role": "assistant", "content": text}]) because the prompts are chat
    messages; `answer` is the dataset column of that name, one per completion.
    """
    return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer)]


ANSWER_LINE = re.compile(r"^[ \t]*answer:[ \t]*([+-]?[0-9]+)[ \t\r]*$", re.IGNORECASE | re.MULTILINE)
"""megatron_gspo/rewards/verifiers.py's _ANSWER_LINE, copied (this script does not import the project)."""


def final_answer_reward(completions, answer, **_) -> list[float]:
    """TRL reward function: 1.0 where the integer on the completion's last "answer: N" line equals the answer."""
    scores = []
    for c, a in zip(completions, answer):
        stated = ANSWER_LINE.findall(c[0]["content"])
        scores.append(float(bool(stated) and int(stated[-1]) == int(a.strip())))
    return scores


REWARDS = {"exact_match": exact_match_reward, "final_answer": final_answer_reward}


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that times its rollout phase per generation batch: `_generate` (sampling with
    `generate()`), the no-grad log-prob forward of pi_old inside it, and the whole
    `_generate_and_score_completions` (generation + rewards + pi_old + advantages)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_times: list[dict] = []
        self._in_rollout = False

    def _generate_and_score_completions(self, inputs):
        self._in_rollout, times = True, {"generate_s": 0.0, "recompute_s": 0.0}
        self.rollout_times.append(times)
        start = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            times["rollout_s"] = time.perf_counter() - start
            self._in_rollout = False

    def _generate(self, prompts):
        start = time.perf_counter()
        result = super()._generate(prompts)
        self.rollout_times[-1]["generate_s"] += time.perf_counter() - start
        return result

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not self._in_rollout:  # the training forward of a mini-batch
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        start = time.perf_counter()
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self.rollout_times[-1]["recompute_s"] += time.perf_counter() - start
        return result


class StepLog(TrainerCallback):
    """Writes one JSON line per rollout step (every `minibatches` optimizer steps): its wall time from the end
    of the previous rollout step, the rollout phase's timings, and the mean reward of its samples."""

    def __init__(self, out: Path, minibatches: int, rewards: list[list[float]], tokens: list[int]):
        self.out, self.minibatches, self.rewards, self.tokens = out, minibatches, rewards, tokens
        self.trainer: TimedGRPOTrainer | None = None
        self._file = None
        self._last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._file = open(self.out, "w")
        self._write({"event": "train_begin", "unix_time": time.time()})
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.minibatches:
            return
        now = time.perf_counter()
        step = state.global_step // self.minibatches
        times = self.trainer.rollout_times[step - 1]
        rewards = self.rewards[step - 1]
        self._write({"step": step, "reward_mean": sum(rewards) / len(rewards), "samples": len(rewards),
                     "completion_tokens": self.tokens[step - 1],
                     "step_s": now - self._last, **times, "train_s": now - self._last - times["rollout_s"]})
        self._last = now

    def on_train_end(self, args, state, control, **kwargs):
        self._file.close()

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (megatron-gspo tiny-model)")
    p.add_argument("--data", required=True, help="JSONL of {'prompt': [chat messages], 'answer': str}")
    p.add_argument("--out", required=True, help="JSONL written: one record per rollout step")
    p.add_argument("--work-dir", required=True, help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--steps", type=int, required=True, help="rollout steps")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16, help="prompts per rollout step")
    p.add_argument("--minibatches", type=int, default=8, help="optimizer steps per rollout step")
    p.add_argument("--eps-low", type=float, default=3e-4)
    p.add_argument("--eps-high", type=float, default=4e-4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reward", choices=sorted(REWARDS), default="exact_match")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    batch = a.prompts * a.group_size
    if batch % a.minibatches:
        raise SystemExit(f"--prompts x --group-size = {batch} does not split into --minibatches={a.minibatches}")
    records = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in records])
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)

    rewards: list[list[float]] = []
    tokens: list[int] = []
    score = REWARDS[a.reward]

    def reward(completions, answer, completion_ids=None, **kwargs) -> list[float]:
        scores = score(completions, answer)
        rewards.append(scores)  # called once per generation batch, with all its samples
        # completion_ids: TRL's generated ids, cut after the first EOS (which they keep)
        tokens.append(sum(len(ids) for ids in completion_ids) if completion_ids is not None else -1)
        return scores
    reward.__name__ = a.reward

    config = GRPOConfig(
        output_dir=a.work_dir, use_cpu=True, bf16=False, fp16=False, seed=a.seed, data_seed=a.seed,
        max_steps=a.steps * a.minibatches, per_device_train_batch_size=batch // a.minibatches,
        gradient_accumulation_steps=1, steps_per_generation=a.minibatches, num_iterations=1,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens, temperature=a.temperature,
        top_p=1.0, top_k=0, beta=0.0, epsilon=a.eps_low, epsilon_high=a.eps_high,
        importance_sampling_level="sequence", loss_type="grpo", scale_rewards="group",
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=a.clip_grad,
        shuffle_dataset=True, save_strategy="no", report_to="none", logging_steps=a.minibatches,
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    log = StepLog(Path(a.out), a.minibatches, rewards, tokens)
    trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward, args=config,
                               train_dataset=dataset, callbacks=[log])
    log.trainer = trainer
    trainer.train()


if __name__ == "__main__":
    main()
