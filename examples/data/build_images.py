"""Build the image-captioning example (jobs/caption-images.yaml): 8 small PNGs drawn here with Pillow (shapes,
stripes, a receipt's text: no outside picture, so no licence beyond this repository's) in `images/`, and
`images.parquet` naming them, one row per question.

Columns: `id` (string), `image` (list<string>: paths relative to this folder, where jobrunner looks for a
relative path), `prompt` (string). Row `shapes-two` holds two images. Run once by a maintainer; the job reads the
committed files.
Usage: python examples/data/build_images.py
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

HERE = Path(__file__).parent
SIZE = (128, 96)
CAPTION = "Describe the picture in one sentence."


def _canvas(color: tuple[int, int, int]) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", SIZE, color)
    return image, ImageDraw.Draw(image)


def red_square() -> Image.Image:
    image, draw = _canvas((40, 70, 200))
    draw.rectangle([36, 20, 92, 76], fill=(220, 30, 30))
    return image


def green_circle() -> Image.Image:
    image, draw = _canvas((245, 245, 235))
    draw.ellipse([34, 18, 94, 78], fill=(30, 160, 60))
    return image


def yellow_triangle() -> Image.Image:
    image, draw = _canvas((20, 20, 20))
    draw.polygon([(64, 10), (114, 86), (14, 86)], fill=(250, 210, 30))
    return image


def stripes() -> Image.Image:
    image, draw = _canvas((255, 255, 255))
    for i, color in enumerate([(200, 0, 0), (255, 140, 0), (240, 220, 0), (0, 150, 0), (0, 80, 200)]):
        draw.rectangle([0, i * 19, SIZE[0], i * 19 + 18], fill=color)
    return image


def checkerboard() -> Image.Image:
    image, draw = _canvas((255, 255, 255))
    for row in range(6):
        for col in range(8):
            if (row + col) % 2:
                draw.rectangle([col * 16, row * 16, col * 16 + 15, row * 16 + 15], fill=(0, 0, 0))
    return image


def receipt() -> Image.Image:
    image, draw = _canvas((250, 250, 245))
    for i, line in enumerate(["COFFEE   3.50", "BAGEL    2.25", "TEA      2.00", "TOTAL    7.75"]):
        draw.text((10, 8 + i * 20), line, fill=(0, 0, 0))
    return image


def house() -> Image.Image:
    image, draw = _canvas((150, 200, 255))
    draw.rectangle([0, 76, SIZE[0], SIZE[1]], fill=(60, 150, 50))
    draw.rectangle([40, 46, 88, 80], fill=(180, 90, 40))
    draw.polygon([(34, 46), (64, 20), (94, 46)], fill=(120, 30, 30))
    draw.ellipse([100, 6, 120, 26], fill=(255, 220, 0))
    return image


def bars() -> Image.Image:
    image, draw = _canvas((255, 255, 255))
    for i, height in enumerate([30, 60, 45, 80, 20]):
        draw.rectangle([12 + i * 22, 90 - height, 28 + i * 22, 90], fill=(50, 90, 180))
    draw.line([8, 90, 120, 90], fill=(0, 0, 0), width=2)
    return image


PICTURES = {"red-square": red_square, "green-circle": green_circle, "yellow-triangle": yellow_triangle,
            "stripes": stripes, "checkerboard": checkerboard, "receipt": receipt, "house": house, "bars": bars}
QUESTIONS = {"receipt": "Read the receipt and give its total.", "bars": "Which bar is the tallest?"}


def main() -> None:
    folder = HERE / "images"
    folder.mkdir(exist_ok=True)
    for name, draw in PICTURES.items():
        draw().save(folder / f"{name}.png", optimize=True)
    ids, images, prompts = [], [], []
    for name in PICTURES:
        ids.append(name)
        images.append([f"images/{name}.png"])
        prompts.append(QUESTIONS.get(name, CAPTION))
    ids.append("shapes-two")
    images.append(["images/red-square.png", "images/green-circle.png"])
    prompts.append("What is different between the two pictures?")
    table = pa.table({"id": ids, "image": pa.array(images, pa.list_(pa.string())), "prompt": prompts})
    pq.write_table(table, HERE / "images.parquet")


if __name__ == "__main__":
    main()
