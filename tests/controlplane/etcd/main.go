// Command etcd is etcd's own server (go.etcd.io/etcd/server/v3/etcdmain) built at the version go.mod pins.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
