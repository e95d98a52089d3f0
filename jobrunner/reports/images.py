"""The images of a job's rows in its report: how many per row, their prompt tokens, and the input cost split
into text and image tokens.

Input cost is shared out by token count: an image token costs what a text token of the same prompt costs
(the vision encoder's time is part of the prefill time the input cost is made of, so it is spread over all
input tokens). `usd_per_image` is the image tokens' share of the input cost over the images: what captioning
one image costs on the input side; both per-image figures count the images the model read (those of rows with
image tokens: not an error row's).
"""

from __future__ import annotations

from jobrunner.reports.cost import PER_MILLION, ratio


def image_block(figures: dict[str, int] | None) -> dict | None:
    """The report's ``images``: totals and per-row figures; None when the rows cannot carry images."""
    if figures is None:
        return None
    images, tokens = figures["images"], figures["image_tokens"]
    return {"total": images, "rows_with_images": figures["image_rows"],
            "per_row": ratio(images, figures["prompts"]), "per_image_row": ratio(images, figures["image_rows"]),
            "max_per_row": figures["max_images"], "tokens": tokens if images else 0,
            "read": figures["images_with_tokens"], "tokens_per_image": ratio(tokens, figures["images_with_tokens"]),
            "rows_unreported": figures["image_rows_unreported"]}


def split_tokens(tokens: dict, images: dict | None) -> None:
    """``tokens`` gains ``text_input`` and ``image_input`` where the rows can carry images (None when none
    does); a job without images keeps its report as before."""
    if images is None:
        return
    image_tokens = images["tokens"] if images and images["total"] else None
    tokens["image_input"] = image_tokens
    tokens["text_input"] = None if image_tokens is None else tokens["input"] - image_tokens


def split_cost(cost: dict, tokens: dict, images: dict | None) -> None:
    """``cost`` (and its ``token_priced``) gains the input cost of image and of text tokens and $ per image,
    where the rows can carry images."""
    if images is None:
        return
    image_tokens, num_images = tokens.get("image_input"), images.get("read")  # images the model read
    share = ratio(image_tokens, tokens["input"]) if image_tokens is not None else None
    input_usd = cost.get("input_usd")
    cost["image_input_usd"] = None if share is None or input_usd is None else input_usd * share
    cost["text_input_usd"] = None if cost["image_input_usd"] is None else input_usd - cost["image_input_usd"]
    cost["usd_per_image"] = ratio(cost["image_input_usd"], num_images)
    priced = cost.get("token_priced")
    if priced is not None:
        price = priced.get("usd_per_m_input")
        usd = None if image_tokens is None or price is None else image_tokens * price / PER_MILLION
        priced["image_input_usd"], priced["usd_per_image"] = usd, ratio(usd, num_images)


def image_warnings(images: dict | None) -> list[str]:
    """A warning when the engine did not count the image tokens of some rows (their input stays all text)."""
    if not images or not images["rows_unreported"]:
        return []
    return [f"{images['rows_unreported']:,} rows with images have no image-token count (the engine does not "
            "report one): their image tokens are counted as text input"]
