"""What the sweeps, the benchmarks and the runs table use, and no recipe's training needs.

    measure  step timing and the CUDA memory breakdown
    report   markdown + CSV + PNG tables
    runs     `python -m tools.runs runs/`: a table comparing finished runs
    budget   `python -m tools.budget`: the tokens of each recipe, its default path and the opt-in modules
"""
