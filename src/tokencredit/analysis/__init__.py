"""The analysis layer: tools that read runs and credit: compare (specs x seeds), inspect (the HTML
page), fidelity (credit against true credit) and bench (the controlled benchmark). It imports the
layers below; nothing below imports it.
"""
