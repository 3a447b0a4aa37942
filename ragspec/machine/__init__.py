"""This machine's measurements: which backend and dtype answer fastest here (`table`), the measuring children
(`measure`) and the background job that fills the table without taking the CPU from the user (`job`)."""
