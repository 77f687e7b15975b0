// etcd for the test control plane: etcd's own server entry point, built
// from its published module (go install cannot build it directly).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
