"""SmolLM2-135M-Instruct (the preset) on the shipped A/B dataset: a CAA vector trained on 20 of its
questions steers the other 10 towards the happier answer (steerability slope > 0), and its cost on
neutral text is measured (zero at strength 0, growing with the strength). Marked `real`."""
import pytest

import kvwire as kw

pytestmark = pytest.mark.real


def test_a_caa_vector_steers_held_out_questions_and_its_cost_is_measured():
    lm = kw.load("smollm2-135m-instruct", progress=False)
    data = kw.steer.dataset("sentiment-ab")
    train, held_out = (kw.steer.ABDataset(data.examples[a:b], name) for a, b, name in
                       ((0, 20, "train"), (20, 30, "held out")))
    vec = kw.ControlVector.train(lm, *train.pairs(), layers=[10], method="caa", progress=False)
    neutral = kw.steer.neutral_text().split("\n\n")[0]
    result = kw.steer.evaluate(lm, vec, held_out, [-4.0, 0.0, 4.0], neutral=neutral)
    print(f"logit diff {result.logit_diff}, slope {result.slope_mean:+.4f} ± {result.slope_std:.4f}, "
          f"{result.anti_steerable:.0%} anti-steerable, KL {result.kl}, perplexity {result.perplexity} "
          f"(unsteered {result.base_perplexity:.2f})")
    assert result.slope_mean > 0 and result.logit_diff[2] > result.logit_diff[0]
    assert result.kl[1] == pytest.approx(0.0, abs=1e-6) and min(result.kl[0], result.kl[2]) > 0
    assert result.ppl_increase[1] == pytest.approx(0.0, abs=1e-5)
    assert 1 < result.base_perplexity < 100 and result.neutral_tokens > 50
