"""Vision-language policies (image in, text out): ``VisionLanguagePolicy`` and the image-row formats it reads."""

from unialign.vision.media import load_image, multimodal_prompt, vision_rows
from unialign.vision.policy import VisionLanguagePolicy

__all__ = ["VisionLanguagePolicy", "load_image", "multimodal_prompt", "vision_rows"]
