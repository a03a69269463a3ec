"""The demo's fixed numbers: per-engine defaults, probe prompts and tolerances, the share of memory a
sleep must free, the sabotage names."""

SABOTAGES = ("none", "drop-weights", "skip-sleep")
DEFAULT_STEPS = {"torch": 12, "vllm": 6}
DEFAULT_LR = {"torch": 0.003, "vllm": 0.01}
RELEASED_MIN = 0.9  # a sleep must free at least this share of the engine's resident bytes

# the embedded engine (TorchGenerator)
PROMPT_LEN = 4  # tokens per rollout prompt
LEARNED_MIN = 0.05  # the reward must rise by at least this much (first quarter of steps -> last quarter)
LEARNED_MIN_STEPS = 4  # fewer steps cannot show it
PROBE_PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
PROBE_TOL = 1e-3  # |engine − trainer| logprob on the probe: kernel noise is ~1e-6 here
BUCKET_BYTES = 4 << 20  # the model is ~0.5 MiB: one bucket

# --engine vllm
VLLM_PROBE_PROMPTS = [[0, 5, 17, 42, 99], [0, 7, 300, 12, 8], [0, 900, 3, 4, 5], [0, 64, 128, 256, 512]]
VLLM_PROBE_TOL = 1e-3  # |engine − trainer| logprob on the greedy probe; both float32, kernel noise ~1e-5
VLLM_KV_BYTES = 256 << 20
VLLM_REWARD_MOD = 8  # reward: fraction of tokens t with t % 8 == target % 8 (about 1/8 at the start)
MiB = 1 << 20
