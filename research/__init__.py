"""Research beside the product, outside the installed package: feature-fed draft heads and the drafts' training
(research/README.md). The product (cloud/, edge/, shared/, modelprep/) never imports it."""
