"""placeholder: being written"""
