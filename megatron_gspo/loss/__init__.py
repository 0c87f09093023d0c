"""Pure loss math: log-probs from vocab-sharded logits, policy losses, group advantages."""
from megatron_gspo.loss.advantages import GroupAdvantages, group_advantages
from megatron_gspo.loss.policy import DEFAULT_CLIP, clip_range, policy_loss, reduce_metrics, summarize_metrics
from megatron_gspo.loss.logprobs import vocab_parallel_logprobs
