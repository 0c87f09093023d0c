"""Weight sync trainer -> rollout servers (disk / tensor / broadcast) from (HF name, tensor) pairs."""
