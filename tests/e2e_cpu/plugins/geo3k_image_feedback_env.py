"""An interaction environment for slime's `examples/geo3k_vlm_multi_turn` rollout (named by file path in the
custom config's `rollout_interaction_env_path`) whose every observation brings a new image.

It is slime's `Geo3kEnv` (tool-call parsing, grading with `grade_answer_verl`), except that an episode goes on to
`max_turns` whatever the response: a tiny random model never writes a valid `<tool_call>`, and `Geo3kEnv` would end
the episode after the first turn. Each observation carries one image under `multi_modal_data`, which the example's
`BaseInteractionEnv.format_observation` puts into the user turn, so the rollout appends NEW image tokens inside the
response region (loss mask 0) and sends the images to the engine. The images differ in size from turn to turn, so
their token counts differ.

Needs slime's `examples` package (the example folder) on `sys.path`.
"""

from __future__ import annotations

from examples.geo3k_vlm_multi_turn.env_geo3k import Geo3kEnv
from PIL import Image


class ImageFeedbackEnv(Geo3kEnv):
    def step(self, response_text: str):
        obs, done, info = super().step(response_text)
        if self.turn >= self.max_turns:
            return obs, True, info
        side = 28 * (1 + self.turn % 3)
        image = Image.new("RGB", (side, 2 * side), (40 * self.turn % 256, 200, 90))
        return {**obs, "multi_modal_data": {"image": [image]}}, False, info


def build_env(sample=None, args=None, **_):
    return ImageFeedbackEnv(ground_truth=None if sample is None or sample.label is None else str(sample.label),
                            max_turns=args.max_turns)
