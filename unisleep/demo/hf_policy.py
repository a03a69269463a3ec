"""The trainer of ``--engine vllm``: the served checkpoint as a Hugging Face ``LlamaForCausalLM``
in float32 with Adam, in the demo's own process (:class:`HFPolicy`)."""

from __future__ import annotations

from typing import Optional


class HFPolicy:
    """The trainer: the served checkpoint as a Hugging Face LlamaForCausalLM in float32 + Adam."""

    def __init__(self, model_dir: str, lr: float):
        import torch
        from transformers import LlamaForCausalLM

        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()  # no dropout in Llama; eval only silences the training-mode paths
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.previous: Optional[dict] = None  # parameters before the last step

    def named(self, previous: bool = False) -> list:
        if previous:
            return list(self.previous.items())
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def logprobs(self, prompts, completions, params: Optional[dict] = None):
        """Full-vocabulary logprob of each completion token (a list of 1-d tensors)."""
        torch = self.torch
        if len({len(p) for p in prompts}) == 1 and len({len(c) for c in completions}) == 1:  # one batch
            ids = torch.tensor([list(p) + list(c) for p, c in zip(prompts, completions)])
            fwd = self.model if params is None else (
                lambda input_ids: torch.func.functional_call(self.model, params, (input_ids,)))
            logits = fwd(input_ids=ids).logits
            lp = torch.log_softmax(logits[:, len(prompts[0]) - 1:-1].float(), dim=-1)
            lp = lp.gather(-1, torch.tensor([list(c) for c in completions])[..., None]).squeeze(-1)
            return list(lp.unbind(0))
        out = []
        for p, c in zip(prompts, completions):
            ids = torch.tensor([list(p) + list(c)])
            if params is None:
                logits = self.model(input_ids=ids).logits
            else:
                logits = torch.func.functional_call(self.model, params, (ids,)).logits
            lp = torch.log_softmax(logits[0, len(p) - 1:-1].float(), dim=-1)
            out.append(lp.gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
        return out

    def score(self, prompts, completions, previous: bool = False) -> list[list[float]]:
        with self.torch.no_grad():
            lps = self.logprobs(prompts, completions, params=self.previous if previous else None)
        return [lp.tolist() for lp in lps]

    def train(self, prompts, completions, rewards) -> list[list[float]]:
        """One REINFORCE step; returns the pre-step logprobs of the rollouts (the gap's input)."""
        torch = self.torch
        self.previous = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        lps = self.logprobs(prompts, completions)
        r = torch.tensor(rewards, dtype=torch.float32)
        adv = r - r.mean()
        loss = -torch.stack([a * lp.sum() for a, lp in zip(adv, lps)]).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return [lp.detach().tolist() for lp in lps]
