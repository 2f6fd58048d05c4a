"""Fashion-MNIST written as an image folder, to try the scripts on "your own data":
DIR/train/<class>/<index>.png and DIR/val/... (the test set), grayscale 28x28 PNG files, each class
named with its label first so that sorting keeps the label order (as ImageFolder numbers classes).

    python examples/write_images.py DIR [--train-samples N] [--test-samples N]
"""
import argparse, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from PIL import Image
import common

CLASSES = ("t-shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle_boot")

def write_images(data_dir, out, train_samples=None, test_samples=None):
    from torchvision.datasets import FashionMNIST
    common.fashion_mnist(data_dir)   # there (downloaded into ./data), or what to do, said
    for train, split, n in ((True, "train", train_samples), (False, "val", test_samples)):
        data = FashionMNIST(data_dir or "data", train=train)
        images, labels = data.data[:n], data.targets[:n]
        for label, name in enumerate(CLASSES):
            os.makedirs(os.path.join(out, split, f"{label}_{name}"), exist_ok=True)
        for index, (image, label) in enumerate(zip(images, labels.tolist())):
            Image.frombytes("L", (28, 28), image.numpy().tobytes()).save(
                os.path.join(out, split, f"{label}_{CLASSES[label]}", f"{index:05d}.png"))
        print(f"wrote {len(labels)} images to {os.path.join(out, split)}")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", metavar="DIR", help="the folder to write")
    parser.add_argument("--data-dir", help="a folder with Fashion-MNIST (FashionMNIST/raw/); default: ./data, where "
                        "it is downloaded")
    parser.add_argument("--train-samples", type=common.positive_int, help="only the first N training images")
    parser.add_argument("--test-samples", type=common.positive_int, help="only the first N test images")
    args = parser.parse_args()
    write_images(args.data_dir, args.out, args.train_samples, args.test_samples)
