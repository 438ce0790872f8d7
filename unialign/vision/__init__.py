"""Vision-language policies (image in, text out): ``VisionLanguagePolicy`` and the image-row formats it reads."""

from unialign.vision.media import VideoSampling, load_image, load_video, multimodal_prompt, vision_rows
from unialign.vision.policy import VisionLanguagePolicy

__all__ = ["VideoSampling", "VisionLanguagePolicy", "load_image", "load_video", "multimodal_prompt", "vision_rows"]
